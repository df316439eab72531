//! `bcd sim`: many real agents in one process, on seeded fake machines, against a real
//! gateway (`fakehw` builds only). Machine `i` is the fake machine of seed `S + i` with its own
//! data directory `DIR/node-i` (node key, identity, journal, status socket), so each agent is
//! exactly what `bcd node` runs: [`crate::join::join_as`] for the join and
//! [`crate::driver::run`] for the session, the journal, commands and the inventory; nothing here
//! is a second implementation. At most [`SIM_JOINS_AT_ONCE_MAX`] joins are in flight at once
//! (a semaphore), so a thousand machines do not arrive at the gateway in one burst. A machine
//! whose data directory holds an identity reuses it: a restarted `bcd sim` rejoins nothing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::{Semaphore, watch};

use crate::config::{Config, load_identity};
use crate::token::{Source, Token};

/// Joins in flight at once.
pub const SIM_JOINS_AT_ONCE_MAX: usize = 16;
/// Machines one `bcd sim` runs at most.
pub const SIM_NODES_MAX: u32 = 10_000;
/// Files one machine holds open (its journal, WAL and shared memory, its status socket, its
/// connection to the gateway, and one to spare), measured at about five.
pub const SIM_FILES_PER_MACHINE: u64 = 6;
/// Files the process needs besides its machines.
pub const SIM_FILES_RESERVE: u64 = 64;
/// Progress lines at most per phase (`joined k/N` every `N / this` joins).
pub const SIM_PROGRESS_LINES_MAX: u32 = 100;

/// What `bcd sim` was asked to run.
pub struct SimOptions {
    pub nodes: u32,
    pub seed: u64,
    /// `DIR`: machine `i` lives in `DIR/node-i`.
    pub data_dir: PathBuf,
    /// The configuration the machines share (gateway, pins, log, observe interval); its own
    /// `data_dir` and `[hardware] fake_seed` are replaced per machine.
    pub base: Config,
}

/// Machine `i`'s data directory.
pub fn node_dir(data_dir: &Path, i: u32) -> PathBuf {
    data_dir.join(format!("node-{i}"))
}

/// Machine `i`'s configuration: the shared one, in its own directory, on the fake machine of
/// seed `seed + i` (and so on the fake hypervisor).
pub fn node_config(base: &Config, data_dir: &Path, seed: u64, i: u32) -> Result<Config, String> {
    let machine_seed = seed.checked_add(u64::from(i)).ok_or("--seed plus --nodes overflows a u64")?;
    let mut config = base.clone();
    config.data_dir = node_dir(data_dir, i);
    config.hardware.fake_seed = Some(machine_seed);
    // A simulated machine's instances are the fake hypervisor's, in memory.
    config.hypervisor.uri = None;
    Ok(config)
}

/// Checks the bounds on `--nodes` and the seeds it implies.
pub fn check(nodes: u32, seed: u64) -> Result<(), String> {
    if nodes == 0 || nodes > SIM_NODES_MAX {
        return Err(format!("--nodes is 1 to {SIM_NODES_MAX}"));
    }
    seed.checked_add(u64::from(nodes - 1)).ok_or("--seed plus --nodes overflows a u64")?;
    Ok(())
}

/// The soft limit on open files in the text of `/proc/self/limits`; `None`: unlimited or
/// unknown.
pub fn open_files_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..].split_whitespace().next()?.parse().ok()
}

/// Refuses a run the open-files limit would break halfway (a join or a journal failing with
/// `EMFILE`), and says how to raise it.
pub fn check_open_files(nodes: u32, limit: Option<u64>) -> Result<(), String> {
    let needed = u64::from(nodes) * SIM_FILES_PER_MACHINE + SIM_FILES_RESERVE;
    match limit {
        Some(limit) if limit < needed => {
            Err(format!("{nodes} machines need about {needed} open files and the limit is {limit} (hint: ulimit -n {needed})"))
        }
        _ => Ok(()),
    }
}

/// Whether progress is worth a line at `done` of `total`.
fn progress_line(done: u32, total: u32) -> bool {
    let step = (total / SIM_PROGRESS_LINES_MAX).max(1);
    done == total || done.is_multiple_of(step)
}

/// Runs the machines until `shutdown`. `token` is asked for only when some machine has not
/// joined. Stopping waits for the joins in flight (at most [`SIM_JOINS_AT_ONCE_MAX`]) to end, so
/// every join the gateway took leaves its identity on disk. A join that fails stops every machine (the identities already written stay, so a
/// run with a new token joins only the rest); an agent that stops with an error is reported and
/// the others run on. `Err` when anything failed.
pub async fn run(
    options: SimOptions,
    token: impl FnOnce() -> Result<String, String>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    check(options.nodes, options.seed)?;
    check_open_files(options.nodes, std::fs::read_to_string("/proc/self/limits").ok().as_deref().and_then(open_files_limit))?;
    let mut machines = Vec::with_capacity(options.nodes as usize);
    let mut unjoined = 0u32;
    for i in 0..options.nodes {
        let config = node_config(&options.base, &options.data_dir, options.seed, i)?;
        std::fs::create_dir_all(&config.data_dir).map_err(|e| format!("creating {}: {e}", config.data_dir.display()))?;
        let joined = load_identity(&config).map_err(|e| format!("node-{i}: {e}"))?.is_some();
        unjoined += u32::from(!joined);
        machines.push(config);
    }
    let secret = if unjoined > 0 { Some(token()?) } else { None };
    eprintln!("bcd sim: {} machines, {} joined already, {unjoined} to join", options.nodes, options.nodes - unjoined);

    let (stop_tx, stop_rx) = watch::channel(false);
    let joins = Arc::new(Semaphore::new(SIM_JOINS_AT_ONCE_MAX));
    let joined = Arc::new(AtomicU32::new(options.nodes - unjoined));
    let total = options.nodes;
    let mut tasks = tokio::task::JoinSet::new();
    for (i, config) in machines.into_iter().enumerate() {
        let (joins, joined, secret, stop_tx, mut stop_rx) =
            (joins.clone(), joined.clone(), secret.clone(), stop_tx.clone(), stop_rx.clone());
        tasks.spawn(async move {
            let identity = match load_identity(&config).map_err(|e| format!("node-{i}: {e}"))? {
                Some(identity) => identity,
                None => {
                    let secret = secret.ok_or_else(|| format!("node-{i}: no join token"))?;
                    // Stopping cancels a machine waiting for its turn, never a join in flight:
                    // a join the gateway took whose identity was not written would leave a
                    // node no machine can run (and a use of the token spent).
                    let permit = tokio::select! {
                        permit = joins.acquire_owned() => permit.map_err(|e| e.to_string())?,
                        _ = stop_rx.wait_for(|stop| *stop) => return Ok(()),
                    };
                    let token = Token { secret, source: Source::Environment };
                    let joined_now = crate::join::join_as(&config, token, None, &format!("sim-{i}"), None)
                        .await
                        .map_err(|e| format!("node-{i}: {}", e.message));
                    drop(permit);
                    if let Err(message) = joined_now {
                        let _ = stop_tx.send(true);
                        return Err(message);
                    }
                    let done = joined.fetch_add(1, Ordering::Relaxed) + 1;
                    if progress_line(done, total) {
                        eprintln!("bcd sim: joined {done}/{total}");
                    }
                    load_identity(&config)
                        .map_err(|e| format!("node-{i}: {e}"))?
                        .ok_or_else(|| format!("node-{i}: joined, but no identity was written"))?
                }
            };
            if *stop_rx.borrow() {
                return Ok(());
            }
            let stopped = async move {
                let _ = stop_rx.wait_for(|stop| *stop).await;
            };
            crate::driver::run(config, identity, stopped).await.map_err(|e| format!("node-{i}: {e}"))
        });
    }
    drop(stop_rx);
    tokio::pin!(shutdown);
    let mut failures = Vec::new();
    let mut signalled = false;
    while !tasks.is_empty() {
        tokio::select! {
            _ = &mut shutdown, if !signalled => {
                signalled = true;
                eprintln!("bcd sim: stopping {} agents", tasks.len());
                let _ = stop_tx.send(true);
            }
            done = tasks.join_next() => match done {
                Some(Ok(Ok(()))) | None => {}
                Some(Ok(Err(message))) => {
                    eprintln!("bcd sim: {message}");
                    failures.push(message);
                }
                Some(Err(e)) => failures.push(format!("an agent's task ended: {e}")),
            },
        }
    }
    match failures.first() {
        None => Ok(()),
        Some(first) => Err(format!("{} of {total} machines failed; the first: {first}", failures.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Config {
        toml::from_str(
            "data_dir = \"/ignored\"\ngateway = \"http://127.0.0.1:9\"\nlog_key_pin = \"sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"\n",
        )
        .unwrap()
    }

    #[test]
    fn machine_i_has_its_own_directory_and_seed_s_plus_i() {
        let config = node_config(&base(), Path::new("/sim"), 40, 2).unwrap();
        assert_eq!(config.data_dir, Path::new("/sim/node-2"));
        assert_eq!(config.hardware.fake_seed, Some(42));
        assert!(node_config(&base(), Path::new("/sim"), u64::MAX, 1).is_err());
    }

    #[test]
    fn the_bounds_on_nodes_and_seeds() {
        assert!(check(0, 0).is_err());
        assert!(check(1, 0).is_ok());
        assert!(check(SIM_NODES_MAX, 0).is_ok());
        assert!(check(SIM_NODES_MAX + 1, 0).is_err());
        assert!(check(2, u64::MAX).is_err());
        assert!(check(1, u64::MAX).is_ok());
    }

    #[test]
    fn a_run_past_the_open_files_limit_is_refused_with_the_ulimit_to_set() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63459                63459                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(open_files_limit(limits), Some(1024));
        assert_eq!(open_files_limit("Max open files            unlimited            unlimited            files"), None);
        assert!(check_open_files(100, Some(1024)).is_ok());
        let refused = check_open_files(1000, Some(1024)).unwrap_err();
        assert!(refused.contains("ulimit -n 6064"), "{refused}");
        assert!(check_open_files(1000, None).is_ok());
    }

    #[test]
    fn progress_is_at_most_a_hundred_lines_and_always_the_last() {
        assert!((1..=3).all(|d| progress_line(d, 3)));
        assert_eq!((1..=1000).filter(|d| progress_line(*d, 1000)).count(), 100);
        assert_eq!((1..=1001).filter(|d| progress_line(*d, 1001)).count(), 101);
        assert!(progress_line(1001, 1001));
    }
}
