//! deploy/kubernetes/*.yaml validated — not run — against Kubernetes' own OpenAPI schemas (strict: an
//! unknown field fails) by the pinned `kubernetes-validate` from PyPI (scripts/provision-libtorch.sh puts
//! it in the venv the test environment has first on PATH). Works offline: the schemas ship in the package.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The Kubernetes release whose schemas the manifests are checked against.
const KUBERNETES_VERSION: &str = "1.31.0";

fn validator() -> Option<Command> {
    let found = Command::new("kubernetes-validate").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!(
            "SKIPPED: kubernetes-validate is not on PATH; run scripts/provision-libtorch.sh and source its env file"
        );
        return None;
    }
    let mut command = Command::new("kubernetes-validate");
    command.args(["--strict", "--kubernetes-version", KUBERNETES_VERSION]);
    Some(command)
}

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn the_kubernetes_manifests_validate_against_the_schemas() {
    let Some(mut validate) = validator() else { return };
    let files = manifests();
    let names: Vec<String> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["job.yaml", "troupe.yaml"]);
    let out = validate.args(&files).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    // Its exit status reflects the last resource of a file only: every line is read.
    assert!(out.status.success() && !text.contains("did not validate") && !text.contains("ERROR"), "{text}");
    for resource in ["service/troupe", "statefulset/troupe", "configmap/troupe-entrypoint", "job/troupe-train"] {
        assert!(text.contains(&format!("passed for resource {resource}")), "{resource} checked:\n{text}");
    }
}

#[test]
fn the_validator_refuses_a_broken_manifest() {
    let Some(mut validate) = validator() else { return };
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(manifests().into_iter().find(|f| f.ends_with("troupe.yaml")).unwrap()).unwrap();
    // A typo in a field name and a string where an integer belongs.
    let broken = text.replace("serviceName: troupe", "serviceNmae: troupe").replace("replicas: 4", "replicas: four");
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, broken).unwrap();
    let out = validate.arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("did not validate for resource statefulset/troupe"), "{text}");
}
