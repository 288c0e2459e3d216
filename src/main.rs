//! The `oipgate` command line.

use std::io::{Read, Write};
use std::process::ExitCode;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use oipgate::convert::{Form, convert};

/// glibc's malloc hands every large buffer back to the kernel and faults fresh pages in for the next, which for
/// multi-megabyte tensors costs more than decoding them; mimalloc keeps and reuses them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "oipgate",
    version,
    about = "Inference gateway for the Open Inference Protocol (KServe V2)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Shows one inference request in every wire form oipgate speaks, converted and checked end to end.
    Demo,
    /// Converts an inference request read from stdin between wire forms, writing it to stdout.
    Convert {
        #[arg(long, value_enum)]
        from: Form,
        #[arg(long, value_enum)]
        to: Form,
        /// The JSON header's length in a binary-extension body (Inference-Header-Content-Length).
        #[arg(long)]
        header_length: Option<u64>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo => oipgate::demo::run(&mut std::io::stdout()),
        Command::Convert {
            from,
            to,
            header_length,
        } => run_convert(from, to, header_length),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("oipgate: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run_convert(from: Form, to: Form, header_length: Option<u64>) -> Result<(), Box<dyn std::error::Error>> {
    let mut input = Vec::new();
    std::io::stdin().read_to_end(&mut input)?;
    let converted = convert(Bytes::from(input), from, to, header_length)?;
    if let Some(length) = converted.header_length {
        eprintln!("Inference-Header-Content-Length: {length}");
    }
    std::io::stdout().write_all(&converted.body)?;
    Ok(())
}
