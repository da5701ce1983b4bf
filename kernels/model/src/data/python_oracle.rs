//! Hugging Face's Python `tokenizers`, the external oracle of troupe's tokenizer support, for tests: it
//! trains the tokenizers they use and encodes text for comparison (tests/data/tokenizers_oracle.py, see
//! its docstring for the commands), in the provisioned venv.

use crate::oracle::run_python_oracle;

/// Runs tests/data/tokenizers_oracle.py with `args`; its last line of output as JSON, or what went wrong.
pub fn tokenizers_oracle(args: &[&str]) -> Result<serde_json::Value, String> {
    run_python_oracle("tests/data/tokenizers_oracle.py", "tokenizers", args)
}
