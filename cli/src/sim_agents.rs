//! `dev --sim N`: N simulated machines in the dev process, for a first look at a working fleet.
//! Each is a real agent on a seeded fake machine, exactly what `bcd sim` runs
//! (`bc_agent::sim`: the real join, session, journal and commands over gRPC to this process's
//! agents' endpoint); nothing here is a second implementation. They join a pool named
//! [`SIM_POOL`], made on the first start (its id kept in `DATA_DIR/sim/pool.id`), with a join
//! token this process asks its own API for; a later start finds their identities and joins
//! nothing. Fake machines need a build with them (`--features bc-agent/fakehw`; `make dev` has
//! it).

use std::path::PathBuf;

use serde_json::json;

use crate::client::{CliError, Client};

/// Where the machines live, under the data directory (machine `i` in `sim/node-i`).
pub const SIM_DIR: &str = "sim";
/// The pool the machines join.
pub const SIM_POOL: &str = "sim";
/// The file beside the machines that names the pool they joined.
pub const SIM_POOL_FILE: &str = "pool.id";
/// Machines `dev --sim` runs at most (`bcd sim` runs up to `bc_agent::sim::SIM_NODES_MAX`).
pub const SIM_NODES_MAX: u32 = 1_000;
/// Machine `i` is the fake machine of seed `SIM_SEED + i`: the same machines on every start.
pub const SIM_SEED: u64 = 1;

/// Refuses `--sim` before anything starts when this build has no fake machines.
pub fn check_build() -> Result<(), CliError> {
    if bc_agent::FAKE_MACHINES {
        return Ok(());
    }
    Err(CliError::usage("--sim needs fake machines, which this build leaves out")
        .hint("make dev DEV_ARGS='--sim N' builds them in (cargo run --features bc-agent/fakehw)"))
}

/// `--sim N`'s bounds, checked with the flags.
pub fn parse_sim_nodes(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(n) if (1..=SIM_NODES_MAX).contains(&n) => Ok(n),
        _ => Err(format!("--sim is 1 to {SIM_NODES_MAX} machines")),
    }
}

/// What the machines need of the server they join.
pub struct Plan {
    pub nodes: u32,
    /// The API, for the pool and the join token.
    pub api_url: String,
    /// The administrator's token file (`admin.token`).
    pub token_path: PathBuf,
    /// The agents' endpoint as `bcd` names it (`https://…` or `http://…` for h2c).
    pub agents: String,
    pub agents_pin: Option<String>,
    pub log_key_pin: String,
    /// `DATA_DIR/sim`.
    pub data_dir: PathBuf,
}

/// Runs the machines until `stopped` turns true. A failure is logged and ends them; the server
/// runs on.
pub async fn run(plan: Plan, stopped: tokio::sync::watch::Receiver<bool>) {
    if let Err(e) = run_machines(plan, stopped).await {
        tracing::error!(code = %e.code, error = %e.message, "the simulated machines (dev --sim) stopped");
        eprintln!("dev --sim: {}: {}", e.code, e.message);
    }
}

async fn run_machines(plan: Plan, mut stopped: tokio::sync::watch::Receiver<bool>) -> Result<(), CliError> {
    std::fs::create_dir_all(&plan.data_dir)
        .map_err(|e| CliError::new("INTERNAL", format!("creating {}: {e}", plan.data_dir.display())))?;
    let token = std::fs::read_to_string(&plan.token_path)
        .map_err(|e| CliError::new("INTERNAL", format!("reading {}: {e}", plan.token_path.display())))?;
    let client = Client::new(&plan.api_url, Some(token.trim().to_owned()))?;
    let pool = sim_pool(&client, &plan).await?;
    let base = base_config(&plan);
    let unjoined = (0..plan.nodes)
        .filter(|i| {
            let config = bc_agent::sim::node_config(&base, &plan.data_dir, SIM_SEED, *i).ok();
            !config.is_some_and(|c| matches!(bc_agent::config::load_identity(&c), Ok(Some(_))))
        })
        .count();
    let secret = match unjoined {
        0 => None,
        n => {
            let created = client.call("joinTokens.create", &json!({ "poolId": pool, "uses": n }), None).await?;
            created["token"].as_str().map(str::to_owned)
        }
    };
    println!("  sim:       {} machines in pool {SIM_POOL} ({pool}), {}", plan.nodes, plan.data_dir.display());
    let options = bc_agent::sim::SimOptions { nodes: plan.nodes, seed: SIM_SEED, data_dir: plan.data_dir.clone(), base };
    let token = move || secret.ok_or_else(|| "no join token".to_owned());
    let stop = async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    bc_agent::sim::run(options, token, stop).await.map_err(|e| CliError::new("UNAVAILABLE", e))
}

/// The pool the machines joined (named in [`SIM_POOL_FILE`]), or a new one.
async fn sim_pool(client: &Client, plan: &Plan) -> Result<String, CliError> {
    let file = plan.data_dir.join(SIM_POOL_FILE);
    if let Ok(id) = std::fs::read_to_string(&file) {
        let id = id.trim().to_owned();
        match client.call("pools.get", &json!({ "poolId": id }), None).await {
            Ok(_) => return Ok(id),
            Err(e) if e.code == "NOT_FOUND" || e.code == "INVALID_ARGUMENT" => {}
            Err(e) => return Err(e),
        }
    }
    let created = client.call("pools.create", &json!({ "name": SIM_POOL }), None).await?;
    let id = created["poolId"]
        .as_str()
        .ok_or_else(|| CliError::new("INVALID_RESPONSE", "pools.create answered without a poolId"))?
        .to_owned();
    std::fs::write(&file, format!("{id}\n"))
        .map_err(|e| CliError::new("INTERNAL", format!("writing {}: {e}", file.display())))?;
    Ok(id)
}

/// The configuration the machines share; `bc_agent::sim` gives each its own directory and seed.
fn base_config(plan: &Plan) -> bc_agent::config::Config {
    bc_agent::config::Config {
        data_dir: plan.data_dir.clone(),
        gateway: plan.agents.clone(),
        serving_ca_spki_pin: plan.agents_pin.clone(),
        log_key_pin: plan.log_key_pin.clone(),
        observe_interval: None,
        command_root_sha256: None,
        join_signing_key_pin: None,
        join_encryption_key_pin: None,
        journal: Default::default(),
        log: Default::default(),
        hardware: Default::default(),
        hypervisor: Default::default(),
        update: None,
        ssh: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_takes_one_to_a_thousand_machines() {
        assert_eq!(parse_sim_nodes("5"), Ok(5));
        assert_eq!(parse_sim_nodes("1000"), Ok(SIM_NODES_MAX));
        for refused in ["0", "1001", "-1", "five", ""] {
            assert!(parse_sim_nodes(refused).unwrap_err().contains("1 to 1000"), "{refused}");
        }
    }
}
