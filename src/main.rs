//! The `fulcrum` command line: arguments, tracing setup, config loading; the work is
//! handed to the library.

use clap::{Parser, Subcommand, ValueEnum};
use fulcrum::config;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "fulcrum",
    version,
    about = "SIP-aware UDP/TCP load-balancing proxy"
)]
struct Cli {
    /// Log format (overrides `logging.format` of the config).
    #[arg(long, global = true, value_enum)]
    log_format: Option<CliLogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum CliLogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a config file: exit 0 with a summary per vserver, or exit 2 with
    /// `FILE:LINE:COL: field.path: problem` lines on stderr.
    Check {
        /// Config files to check.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

/// Exit status for an invalid config (SPEC section 9).
const EXIT_INVALID: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fulcrum: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Check { files } => Ok(check(&files)),
    }
}

fn check(files: &[PathBuf]) -> ExitCode {
    let mut ok = true;
    for file in files {
        match config::load(file) {
            Ok(cfg) => {
                println!("{}: ok", file.display());
                for line in fulcrum::config::summary(&cfg) {
                    println!("  {line}");
                }
            }
            Err(e) => {
                eprintln!("{e}");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_INVALID)
    }
}
