//! Hugging Face's Python `tokenizers`, the external oracle of troupe's tokenizer support, for tests: it
//! trains the tokenizers they use and encodes text for comparison (tests/data/tokenizers_oracle.py, see
//! its docstring for the commands), in the provisioned venv ([`venv_python`]).

use crate::oracle::venv_python;

/// Runs tests/data/tokenizers_oracle.py with `args`; its last line of output as JSON, or what went wrong.
pub fn tokenizers_oracle(args: &[&str]) -> Result<serde_json::Value, String> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizers_oracle.py");
    let python = venv_python();
    let output = std::process::Command::new(&python).arg(&script).args(args).output().map_err(|e| {
        format!("running {} {}: {e}; provision the venv with `make provision`", python.display(), script.display())
    })?;
    if !output.status.success() {
        return Err(format!(
            "tokenizers_oracle.py {args:?} failed (tokenizers installed? `make provision`):\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().ok_or("tokenizers_oracle.py printed nothing")?;
    serde_json::from_str(last).map_err(|e| format!("tokenizers_oracle.py printed {last:?}: {e}"))
}
