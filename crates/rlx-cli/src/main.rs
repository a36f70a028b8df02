//! `rlx`: the command-line face of RLX.

mod bench;
mod doctor;
mod inspect;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rlx", version, about = "RLX: a compiler and runtime for transformer inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a graph before and after passes, its schedule and arena plan.
    Inspect(inspect::InspectArgs),
    /// Report the CUDA driver, device and libraries RLX can find.
    Doctor,
    /// Time RLX (replay and eager) against PyTorch (eager and CUDA-graph replay) on BERT shapes.
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result: Result<(), String> = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Doctor => {
            doctor::run();
            Ok(())
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
