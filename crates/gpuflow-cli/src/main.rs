//! The `gpuflow` command: argument parsing and wiring only. Data goes to
//! stdout, diagnostics and progress to stderr; exit 0 on success, 1 when the
//! request failed, 2 on a usage error (the command line or, for `sim` and
//! `bench`, their inputs).

mod bench_api;
mod client;
mod contexts;
mod k8s;
mod platform;
mod session;
mod sim;
mod whatif;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Run the platform on this machine: the server with embedded SQLite and a
    /// local agent (NVML GPUs, or four emulated ones where there are none).
    Up(Box<platform::UpArgs>),
    /// Run the control plane (HTTP API, store, scheduling loop).
    Server(Box<platform::ServerArgs>),
    /// Run a node agent that joins a server.
    Agent(platform::AgentArgs),
    /// The agent's own: pull a task's image and become runc (see the
    /// agent's `oci.rs`).
    #[command(hide = true)]
    OciRun { spec: std::path::PathBuf },
    /// gpuflow on Kubernetes: run the scheduler, print its manifests.
    K8s {
        #[command(subcommand)]
        command: k8s::K8sCmd,
    },
    /// Jobs: submit, ls, get, why, logs, cancel, suspend, resume, hold, release.
    Job {
        #[command(subcommand)]
        command: client::JobCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Inference services: ls, create, get, scale, update, delete.
    Service {
        #[command(subcommand)]
        command: client::ServiceCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Queues: ls, create, set, delete.
    Queue {
        #[command(subcommand)]
        command: client::QueueCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Nodes: ls, drain, cordon, uncordon.
    Node {
        #[command(subcommand)]
        command: client::NodeCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Teams: ls, create.
    Team {
        #[command(subcommand)]
        command: client::TeamCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Projects (what jobs are accounted to): ls, create.
    Project {
        #[command(subcommand)]
        command: client::ProjectCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Users: ls, create.
    User {
        #[command(subcommand)]
        command: client::UserCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// API tokens.
    Token {
        #[command(subcommand)]
        command: client::TokenCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Reports: usage (GPU-hours, efficiency, cost) by team, project, user, queue, model.
    Report {
        #[command(subcommand)]
        command: client::ReportCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Prices of a GPU-hour per model, for cost reports: ls, set.
    Price {
        #[command(subcommand)]
        command: client::PriceCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Sign in through the server's identity provider (OpenID Connect, by
    /// the device flow: a code to enter in any browser); the sign-in is
    /// kept, refreshed as needed, in a context of the config file, made
    /// current (`--context NAME` picks its name).
    Login {
        /// The provider, when the server has several.
        #[arg(long)]
        provider: Option<String>,
        /// Sign in through a browser on this machine instead (the
        /// authorization code flow with PKCE, back to a listener on
        /// loopback).
        #[arg(long)]
        browser: bool,
        /// With --browser: the loopback port the browser comes back to
        /// (0: any free one; the provider must accept it).
        #[arg(long, default_value_t = 0, requires = "browser")]
        callback_port: u16,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Who the server takes you for: user, team, role, how you signed in,
    /// when that expires, and where the credentials came from.
    Whoami {
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Contexts (named servers and their credentials), as kubectl has
    /// them: set-context, use-context, get-contexts, current-context,
    /// delete-context.
    Config {
        #[command(subcommand)]
        command: contexts::ConfigCmd,
    },
    /// Shell completions: `gpuflow completion bash > /etc/bash_completion.d/gpuflow`
    /// (or zsh, fish, elvish, powershell).
    Completion { shell: clap_complete::Shell },
    /// The event log.
    Event {
        #[command(subcommand)]
        command: client::EventCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Reservations: windows on nodes for teams, users or maintenance
    /// (like scontrol create reservation): create, ls, rm.
    Reservation {
        #[command(subcommand)]
        command: client::ReservationCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
    /// Webhooks: your jobs' (or a team's) state changes POSTed to a URL,
    /// signed: create, ls, rm, deliveries.
    Webhook {
        #[command(subcommand)]
        command: client::WebhookCmd,
        #[command(flatten)]
        conn: client::Conn,
    },
}

fn main() {
    let cli = Cli::parse();
    // Simulators and benchmarks fail on their arguments and inputs: usage
    // errors. Elsewhere an error is a request that failed, unless it says
    // it is about the command line.
    let local = matches!(cli.command, Command::Sim { .. } | Command::Bench { .. });
    // A client's output piped into `head` ends it quietly, as `cat` or `ls`
    // do, instead of a panic on the broken pipe (exit 101). Long-running
    // processes (server, agent, simulators with in-process servers) keep
    // Rust's default, ignoring SIGPIPE.
    if !local
        && !matches!(
            cli.command,
            Command::Up(_) | Command::Server(_) | Command::Agent(_) | Command::K8s { .. }
        )
    {
        // SAFETY: setting a signal's disposition to its default at start,
        // before any thread is spawned.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Sim { command } => sim::run(command),
        Command::Bench { command } => sim::bench(command),
        Command::Up(a) => platform::up(*a),
        Command::Server(a) => platform::server(*a),
        Command::Agent(a) => platform::agent(a),
        Command::OciRun { spec } => std::process::exit(gpuflow_agent::oci::run(&spec)),
        Command::K8s { command } => k8s::run(command),
        Command::Job { command, conn } => client::job(&conn, command),
        Command::Queue { command, conn } => client::queue(&conn, command),
        Command::Service { command, conn } => client::service(&conn, command),
        Command::Node { command, conn } => client::node(&conn, command),
        Command::Team { command, conn } => client::team(&conn, command),
        Command::Project { command, conn } => client::project(&conn, command),
        Command::User { command, conn } => client::user(&conn, command),
        Command::Token { command, conn } => client::token(&conn, command),
        Command::Event { command, conn } => client::event(&conn, command),
        Command::Webhook { command, conn } => client::webhook(&conn, command),
        Command::Reservation { command, conn } => client::reservation(&conn, command),
        Command::Report { command, conn } => client::report(&conn, command),
        Command::Price { command, conn } => client::price(&conn, command),
        Command::Whoami { conn } => client::whoami(&conn),
        Command::Login {
            provider,
            browser,
            callback_port,
            conn,
        } => contexts::login(&conn, provider.as_deref(), browser.then_some(callback_port)),
        Command::Config { command } => contexts::run(command),
        Command::Completion { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "gpuflow",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        let usage = local || e.downcast_ref::<client::Usage>().is_some();
        std::process::exit(if usage { 2 } else { 1 });
    }
}
