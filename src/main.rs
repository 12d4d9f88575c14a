//! The `effectively` binary: parse the command line and hand over to the library.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = effectively::cli::Cli::parse();
    effectively::cli::main(cli)
}
