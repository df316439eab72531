//! The configuration file, `init`, `version` and `BETTER_COMPUTE_DEBUG` (issue 59, items 4 and 5)
//! from outside: `init` in an empty directory writes `better-compute.toml` and the keys (0600) and
//! refuses a second time; `dev --config` serves on the addresses the file names, with a flag over
//! the file; a flag's environment variable over the file too; a bad file is refused naming its
//! line and key; `version --json` parses; the chain of causes shows only with the debug variable.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use bc_tests::{binary, cli, free_port, json};

/// `better-compute ARGS` in `dir` with `env`, none of the caller's `BETTER_COMPUTE_*` settings;
/// (status, stdout, stderr).
fn run_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(binary("better-compute"));
    command.current_dir(dir).args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("BETTER_COMPUTE_")) {
        command.env_remove(k);
    }
    command.env("BETTER_COMPUTE_CREDENTIALS", "/nonexistent/bc-tests/credentials.json");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.stdin(Stdio::null()).output().expect("run better-compute");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `dev` process, stopped when dropped; its log in `log`.
struct Dev {
    child: Child,
    /// The lines it printed up to its agents' line: the URL first.
    lines: Vec<String>,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Dev {
    /// `better-compute dev ARGS` in `dir`, up to its agents' line; `Err` with its log when it
    /// stops before.
    #[allow(clippy::zombie_processes)] // Waited for in every path: here when it stopped, else by `Drop`.
    fn start(dir: &Path, args: &[&str], log: &Path) -> Result<Dev, String> {
        let mut command = Command::new(binary("better-compute"));
        command
            .current_dir(dir)
            .arg("dev")
            .args(args)
            .env_remove("BETTER_COMPUTE_CONFIG")
            .env_remove("BETTER_COMPUTE_DATABASE_URL");
        let file = std::fs::File::create(log).expect("log file");
        let mut child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(file).spawn().expect("start dev");
        let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            // The process's own end closes the pipe: no wait without an end.
            if reader.read_line(&mut line).expect("read dev's stdout") == 0 {
                let _ = child.wait();
                return Err(format!("dev stopped before serving: {}", std::fs::read_to_string(log).unwrap_or_default()));
            }
            let line = line.trim_end().to_owned();
            let done = line.starts_with("  agents:");
            lines.push(line);
            if done {
                // Later lines (none of any size) go to a reader nobody waits for.
                std::thread::spawn(move || for _ in reader.lines() {});
                return Ok(Dev { child, lines });
            }
        }
    }

    fn url(&self) -> &str {
        self.lines[0].rsplit(' ').next().expect("the URL")
    }

    fn line(&self, prefix: &str) -> &str {
        self.lines.iter().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix:?} line in {:?}", self.lines))
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).permissions().mode() & 0o777
}

/// `text` with the commented line `# KEY = …` replaced by `KEY = VALUE`; panics when absent.
fn set(text: &str, key: &str, value: &str) -> String {
    let prefix = format!("# {key} = ");
    let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {prefix:?} line in the file"));
    text.replacen(line, &format!("{key} = {value}"), 1)
}

#[test]
fn init_writes_the_file_and_keys_and_dev_serves_from_it_under_its_flags() {
    let temp = tempfile::Builder::new().prefix("bc-e2e-config-").tempdir().unwrap();
    let home = temp.path().join("deploy");
    std::fs::create_dir(&home).unwrap();
    let (code, out, err) = run_in(&home, &["init"], &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("next:") && out.contains("better-compute dev"), "the next steps: {out}");
    let config = home.join("better-compute.toml");
    let keys = home.join(".better-compute");
    for file in [config.clone(), keys.join("log.key"), keys.join("data.key"), keys.join("agents-tls.key")] {
        assert_eq!(mode(&file), 0o600, "{}", file.display());
    }
    assert_eq!(mode(&keys), 0o700);
    let written = std::fs::read_to_string(&config).unwrap();
    assert!(written.contains("# listen = \"127.0.0.1:7070\""), "listen commented with its default:\n{written}");
    assert!(written.contains("(env BETTER_COMPUTE_DATABASE_URL)"), "{written}");

    // A second init refuses, writes nothing, and says so with its code.
    let (code, _, err) = run_in(&home, &["init"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("ALREADY_EXISTS: better-compute.toml exists"), "{err}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), written, "the file is untouched");

    // The file's addresses (any free loopback port); dev started from another directory finds
    // the data directory beside the file, with the keys init made.
    let text = set(&set(&written, "listen", "\"127.0.0.1:0\""), "agents-listen", "\"127.0.0.1:0\"");
    std::fs::write(&config, text).unwrap();
    let elsewhere = temp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let config_arg = config.to_str().unwrap();
    let dev = Dev::start(&elsewhere, &["--config", config_arg], &temp.path().join("dev.log")).unwrap_or_else(|e| panic!("{e}"));
    assert!(dev.url().starts_with("http://127.0.0.1:") && !dev.url().ends_with(":7070"), "the file's listen: {}", dev.url());
    let (_, shown, _) = run_in(&home, &["pki", "show"], &[]);
    let pin = json(&shown)["pin"].as_str().unwrap().to_owned();
    assert!(dev.line("  log key:").ends_with(&pin), "init's log key: {} vs {pin}", dev.line("  log key:"));
    assert!(!elsewhere.join(".better-compute").exists(), "nothing in the working directory");
    let token = std::fs::read_to_string(keys.join("admin.token")).unwrap();
    let env = [("BETTER_COMPUTE_URL", dev.url()), ("BETTER_COMPUTE_TOKEN", token.trim())];
    let (code, out, err) = cli(&["api", "system.whoami"], &env);
    assert_eq!(code, 0, "the API answers: {out} {err}");
    drop(dev);

    // A flag wins over the file.
    let mut last = String::new();
    let flagged = (0..5).find_map(|_| {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        match Dev::start(&elsewhere, &["--config", config_arg, "--listen", &listen], &temp.path().join("dev-2.log")) {
            Ok(dev) => Some((dev, port)),
            Err(e) if e.contains("in use") => {
                last = e;
                None
            }
            Err(e) => panic!("{e}"),
        }
    });
    let (dev, port) = flagged.unwrap_or_else(|| panic!("no free port in 5 tries: {last}"));
    assert_eq!(dev.url(), format!("http://127.0.0.1:{port}"), "--listen over the file's");
    drop(dev);

    // The file under a flag's environment variable, and both under the flag: the data key's
    // path as `pki rotate-data-key` names it when there is no key there. A relative path in the
    // file is relative to the file's directory.
    std::fs::write(&config, format!("{}\ndata-key-file = \"keys/none.key\"\n", std::fs::read_to_string(&config).unwrap()))
        .unwrap();
    let rotate = ["pki", "rotate-data-key", "--config", config_arg];
    let (code, _, err) = run_in(&elsewhere, &rotate, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with(&format!("DATA_KEY_NOT_FOUND: no data key at {}", home.join("keys/none.key").display())), "{err}");
    let by_env = [("BETTER_COMPUTE_DATA_KEY_FILE", "/nonexistent/env.key")];
    let (_, _, err) = run_in(&elsewhere, &rotate, &by_env);
    assert!(err.starts_with("DATA_KEY_NOT_FOUND: no data key at /nonexistent/env.key"), "the environment over the file: {err}");
    let flagged: Vec<&str> = rotate.iter().copied().chain(["--data-key-file", "/nonexistent/flag.key"]).collect();
    let (_, _, err) = run_in(&elsewhere, &flagged, &by_env);
    assert!(err.starts_with("DATA_KEY_NOT_FOUND: no data key at /nonexistent/flag.key"), "the flag over both: {err}");
    // The same file found as ./better-compute.toml, and through BETTER_COMPUTE_CONFIG.
    let (_, _, err) = run_in(&home, &["pki", "rotate-data-key"], &[]);
    assert!(err.contains("keys/none.key"), "found in the working directory: {err}");
    let (_, _, err) = run_in(&elsewhere, &["pki", "rotate-data-key"], &[("BETTER_COMPUTE_CONFIG", config_arg)]);
    assert!(err.contains("keys/none.key"), "found through BETTER_COMPUTE_CONFIG: {err}");
}

/// Writes `text` as a configuration file in a new directory; (the directory, the file's path).
fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new().prefix("bc-e2e-config-").tempdir().unwrap();
    let path = dir.path().join("better-compute.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

#[test]
fn a_bad_file_is_refused_by_line_and_key_and_debug_shows_the_causes() {
    // Found in the working directory, the file is named as found.
    let (dir, path) = config_file("listen = \"127.0.0.1:0\"\n\nlisen = \"127.0.0.1:0\"\n");
    let (code, _, err) = run_in(dir.path(), &["dev"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.starts_with("CONFIG_INVALID: better-compute.toml line 3: unknown key `lisen`\nhint: did you mean `listen`?"),
        "{err}"
    );
    let (code, _, err) = run_in(Path::new("/"), &["dev", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with(&format!("CONFIG_INVALID: {} line 3: unknown key `lisen`", path.display())), "{err}");
    assert!(!dir.path().join(".better-compute").exists(), "refused before anything was made");

    let (dir, _) = config_file("data-dir = \"d\"\nlisten = 7070\n");
    let (code, _, err) = run_in(dir.path(), &["serve", "--database-url", "postgres://bc@127.0.0.1:1/bc"], &[]);
    assert_eq!(code, 1);
    assert!(err.starts_with("CONFIG_INVALID: better-compute.toml line 2: `listen` must be a string, not an integer"), "{err}");

    // A password in the file is refused, and never printed.
    let (dir, _) = config_file("database-url = \"postgres://bc:hunter2@127.0.0.1:1/bc\"\n");
    let (code, _, err) = run_in(dir.path(), &["migrate"], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("`database-url` carries a password") && err.contains("BETTER_COMPUTE_DATABASE_URL"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");

    // A file named but missing.
    let (code, _, err) = run_in(dir.path(), &["dev", "--config", "/nonexistent/bc.toml"], &[]);
    assert_eq!(code, 1);
    assert!(err.starts_with("CONFIG_NOT_FOUND: no configuration file at /nonexistent/bc.toml"), "{err}");

    // Not TOML: one line, and with BETTER_COMPUTE_DEBUG=1 the parser's own error beneath it.
    let (dir, _) = config_file("listen = \"127.0.0.1:0\n");
    let (code, _, err) = run_in(dir.path(), &["dev"], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("line 1: not valid TOML") && !err.contains("caused by"), "{err}");
    let (_, _, debug) = run_in(dir.path(), &["dev"], &[("BETTER_COMPUTE_DEBUG", "1")]);
    assert!(debug.starts_with(err.lines().next().unwrap()) && debug.contains("\n  caused by: "), "{debug}");

    // A call to a server that is not there: the transport's causes down to the refused connection.
    // Port 1 (tcpmux): privileged and unused, so nothing answers and no other test can take it.
    let env = [("BETTER_COMPUTE_URL", "http://127.0.0.1:1"), ("BETTER_COMPUTE_TOKEN", "bc_x")];
    let (code, _, plain) = run_in(dir.path(), &["api", "system.whoami"], &env);
    assert_eq!(code, 1);
    assert!(plain.starts_with("UNAVAILABLE: cannot reach") && !plain.contains("caused by"), "{plain}");
    let env = [env[0], env[1], ("BETTER_COMPUTE_DEBUG", "1")];
    let (_, _, debug) = run_in(dir.path(), &["api", "system.whoami"], &env);
    assert!(debug.contains("  caused by: ") && debug.to_lowercase().contains("connection refused"), "{debug}");
}

#[test]
fn version_prints_the_build() {
    let (code, out, err) = cli(&["version", "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["logFormat"], bc_core::event::ENVELOPE_FORMAT);
    assert!(v["target"].as_str().unwrap().contains("linux"), "{v}");
    assert!(v["commit"].is_null() || v["commit"].is_string(), "{v}");
    let (code, out, _) = cli(&["version"], &[]);
    assert_eq!(code, 0);
    assert!(out.starts_with(&format!("better-compute {}\n", env!("CARGO_PKG_VERSION"))), "{out}");
    assert!(out.contains("log format:  1"), "{out}");
    let (code, out, _) = cli(&["--version"], &[]);
    assert_eq!((code, out.trim()), (0, format!("better-compute {}", env!("CARGO_PKG_VERSION")).as_str()));
}
