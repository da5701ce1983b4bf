//! The `troupe` command line (DESIGN.md §3).

fn main() -> std::process::ExitCode {
    troupe_actors::cli::main()
}
