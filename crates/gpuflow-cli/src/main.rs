//! The `gpuflow` command: argument parsing and wiring only. Data goes to
//! stdout, diagnostics and progress to stderr; exit 0 on success, 2 on error.

mod sim;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "gpuflow",
    version,
    about = "GPU compute scheduling for shared clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulators: replay public traces against gpuflow's scheduling core.
    Sim {
        #[command(subcommand)]
        command: sim::SimCommand,
    },
    /// Benchmarks that print figures.
    Bench {
        #[command(subcommand)]
        command: sim::BenchCommand,
    },
    /// Run the platform on this machine (control plane, agent, dashboard).
    Up,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sim { command } => sim::run(command),
        Command::Bench { command } => sim::bench(command),
        Command::Up => Err(anyhow::anyhow!(
            "the control plane is not built yet (issue #4): `gpuflow up` will start it; \
             today the scheduling core can be tried with `gpuflow sim openb`"
        )),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}
