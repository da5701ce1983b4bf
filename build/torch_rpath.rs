//! Build script shared by every crate whose binaries or tests link libtorch: embeds the libtorch
//! directory that torch-sys linked against as an rpath, so the binaries run with no environment
//! variables set (no LD_LIBRARY_PATH). torch-sys (`links = "tch"`) exports that directory as
//! `DEP_TCH_LIBTORCH_LIB` to crates that depend on it directly.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) => println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}"),
        Err(_) => println!(
            "cargo:warning=torch-sys did not report its libtorch directory; binaries will need LD_LIBRARY_PATH"
        ),
    }
}
