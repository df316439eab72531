//! The CLI end to end, against the real binary: every item form of `api` (what arrives at a
//! server, and what a real server creates from it), refusals of bad items, `completion bash`
//! driven by a real bash, `help --json`, the chosen columns of list tables, and
//! `events watch --since start|0`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bc_tests::{Server, cli, cli_stdin, json as json_of};
use serde_json::{Value, json};

/// A stand-in API on loopback that records each method called and the JSON body it got.
struct Capture {
    url: String,
    bodies: Arc<Mutex<Vec<(String, Value)>>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Capture {
    async fn start() -> Capture {
        let bodies: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let recorded = bodies.clone();
        let app = axum::Router::new().route(
            "/api/compute/{method}",
            axum::routing::post(move |axum::extract::Path(method): axum::extract::Path<String>, body: axum::body::Bytes| {
                let recorded = recorded.clone();
                async move {
                    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    recorded.lock().unwrap().push((method, body));
                    axum::Json(json!({ "ok": true }))
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Capture { url, bodies, _stop: stop }
    }

    fn env(&self) -> [(&str, &str); 2] {
        [("BETTER_COMPUTE_URL", self.url.as_str()), ("BETTER_COMPUTE_TOKEN", "key_test.capture")]
    }

    fn last(&self) -> (String, Value) {
        self.bodies.lock().unwrap().last().cloned().expect("a request arrived")
    }
}

/// Runs the CLI on a blocking thread, so the capture server on this runtime can answer it.
async fn run(args: Vec<String>, env: Vec<(String, String)>, stdin: Option<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        cli_stdin(&args, &env, stdin.as_deref())
    })
    .await
    .unwrap()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn env_of(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_item_form_arrives_as_the_reference_table_says() {
    let capture = Capture::start().await;
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, r#"{ "gpus": 2, "tags": ["x", "y"] }"#).unwrap();
    let notes = dir.path().join("notes.md");
    std::fs::write(&notes, "# Notes\nline two\n").unwrap();
    let data = dir.path().join("body.json");
    std::fs::write(&data, r#"{ "fromData": true, "name": "overwritten" }"#).unwrap();

    let args = vec![
        "api".to_owned(),
        "pools.create".to_owned(),
        "name=gpu-a".to_owned(),
        "limit:=10".to_owned(),
        r#"labels:=["a","b"]"#.to_owned(),
        format!("spec:=@{}", spec.display()),
        format!("notes=@{}", notes.display()),
        "resource.type=pool".to_owned(),
        "resource.meta.depth:=2".to_owned(),
        "ids[]=a".to_owned(),
        "ids[]=b".to_owned(),
        "counts[]:=7".to_owned(),
        "--data".to_owned(),
        format!("@{}", data.display()),
    ];
    let (code, _, err) = run(args, env_of(&capture.env()), None).await;
    assert_eq!(code, 0, "{err}");
    let (method, body) = capture.last();
    assert_eq!(method, "pools.create");
    assert_eq!(
        body,
        json!({
            "fromData": true,
            "name": "gpu-a",
            "limit": 10,
            "labels": ["a", "b"],
            "spec": { "gpus": 2, "tags": ["x", "y"] },
            "notes": "# Notes\nline two\n",
            "resource": { "type": "pool", "meta": { "depth": 2 } },
            "ids": ["a", "b"],
            "counts": [7],
        })
    );

    // `--data JSON` and `--data -` (standard input), items on top; --tenant fills tenantId.
    let (code, _, err) = run(
        strings(&[
            "api",
            "events.list",
            "--data",
            r#"{"limit": 3}"#,
            "types[]=pool.*",
            "--tenant",
            "ten_00000000000000000000000000",
        ]),
        env_of(&capture.env()),
        None,
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        capture.last(),
        ("events.list".to_owned(), json!({ "limit": 3, "types": ["pool.*"], "tenantId": "ten_00000000000000000000000000" }))
    );
    let (code, _, err) = run(
        strings(&["api", "webhooks.create", "--data", "-", "eventTypes[]=node.*"]),
        env_of(&capture.env()),
        Some(r#"{ "url": "https://hooks.example.com/x", "eventTypes": ["pool.*"] }"#.to_owned()),
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        capture.last().1,
        json!({ "url": "https://hooks.example.com/x", "eventTypes": ["pool.*", "node.*"] }),
        "an item appends to an array --data gave"
    );
}

#[tokio::test]
async fn item_forms_create_real_resources() {
    let server = Server::dev();
    let dir = tempfile::tempdir().unwrap();
    let description = dir.path().join("description.txt");
    std::fs::write(&description, "GPUs in Amsterdam").unwrap();
    let labels = dir.path().join("labels.json");
    std::fs::write(&labels, r#"{ "site": "ams", "tier": "gold" }"#).unwrap();

    // `k=@file.txt`, `a.b=v`: a string from a file, nested fields.
    let (code, out, err) = server.cli(&[
        "api",
        "pools.create",
        "name=items-a",
        &format!("description=@{}", description.display()),
        "labels.site=ams",
        "labels.rack=r1",
    ]);
    assert_eq!(code, 0, "{err}");
    let pool_a = json_of(&out)["poolId"].as_str().unwrap().to_owned();
    let (_, pool) = server.call("pools.get", json!({ "poolId": pool_a })).await;
    assert_eq!(pool["description"], "GPUs in Amsterdam");
    assert_eq!(pool["labels"], json!({ "site": "ams", "rack": "r1" }));

    // `k:=@file.json`: JSON from a file.
    let (code, out, err) = server.cli(&["api", "pools.create", "name=items-b", &format!("labels:=@{}", labels.display())]);
    assert_eq!(code, 0, "{err}");
    let (_, pool) = server.call("pools.get", json!({ "poolId": json_of(&out)["poolId"] })).await;
    assert_eq!(pool["labels"], json!({ "site": "ams", "tier": "gold" }));

    // `--data @file.json` and `--data -`.
    let body = dir.path().join("pool.json");
    std::fs::write(&body, r#"{ "name": "items-c", "description": "from a file" }"#).unwrap();
    let (code, out, err) = server.cli(&["api", "pools.create", "--data", &format!("@{}", body.display())]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json_of(&out)["description"], "from a file");
    let env = server.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (code, out, err) =
        cli_stdin(&["api", "pools.create", "--data", "-", "labels.from=stdin"], &env, Some(r#"{ "name": "items-d" }"#));
    assert_eq!(code, 0, "{err}");
    assert_eq!((json_of(&out)["name"].as_str(), &json_of(&out)["labels"]), (Some("items-d"), &json!({ "from": "stdin" })));

    // `ids[]=x` (appended to an array), `k:=json`.
    let (code, out, err) = server.cli(&[
        "api",
        "webhooks.create",
        "url=http://127.0.0.1:9/hook",
        "eventTypes[]=pool.*",
        "eventTypes[]=node.registered",
    ]);
    assert_eq!(code, 0, "{err}");
    let (_, hook) = server.call("webhooks.get", json!({ "webhookId": json_of(&out)["webhookId"] })).await;
    assert_eq!(hook["eventTypes"], json!(["pool.*", "node.registered"]));
    let (code, out, err) = server.cli(&["api", "pools.list", "limit:=1", "--format", "compact"]);
    assert_eq!(code, 0, "{err}");
    let page = json_of(&out);
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert!(page["nextCursor"].is_string(), "{page}");
    let (code, out, err) = server.cli(&["api", "apiKeys.create", "name=reader", r#"actions:=["compute:pools:read"]"#]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json_of(&out)["actions"], json!(["compute:pools:read"]));
}

#[tokio::test]
async fn bad_items_exit_2_before_anything_is_sent() {
    let server = Server::dev();
    let before = server.last_commit().await;
    let cases: &[(&[&str], &str)] = &[
        (&["api", "pools.create", "novalue"], "no = in it"),
        (&["api", "pools.create", "=v"], "the key is empty"),
        (&["api", "pools.create", "labels..site=ams"], "segment is empty"),
        (&["api", "pools.create", "labels[].site=ams"], "only the last segment"),
        (&["api", "pools.create", "name:=not-json"], "not JSON"),
        (&["api", "pools.create", "name=@/nonexistent/bc-tests/name.txt"], "cannot read"),
        (&["api", "pools.create", "labels:=@/nonexistent/bc-tests/labels.json"], "cannot read"),
        (&["api", "pools.create", "name=a", "name.first=b"], "name is already a string, not an object"),
        (&["api", "pools.create", "--data", "[1, 2]"], "must be a JSON object"),
        (&["api", "pools.create", "--data", "{nope"], "is not JSON"),
        (&["api", "pools.create", "--data", "@/nonexistent/bc-tests/body.json"], "cannot read"),
        (&["api", "pools.lst"], "did you mean pools.list"),
    ];
    for (args, needle) in cases {
        let (code, _, err) = server.cli(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.starts_with("INVALID_ARGUMENT: ") && err.contains(needle), "{args:?}: {err}");
    }
    assert_eq!(server.last_commit().await, before, "a bad item sends nothing");
}

/// Sources the script in a real bash, sets COMP_WORDS/COMP_CWORD as bash does on TAB, calls
/// the function `complete -p` registered, and returns COMPREPLY.
fn complete(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let cword = words.len() - 1;
    let program = format!(
        r#"source '{script}' || exit 3
function=$(complete -p better-compute | sed -E 's/.*-F ([^ ]+).*/\1/')
COMP_WORDS=({words})
COMP_CWORD={cword}
COMP_LINE="${{COMP_WORDS[*]}}"
COMP_POINT=${{#COMP_LINE}}
"$function" better-compute "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\n' "${{COMPREPLY[@]}}""#,
        script = script.display(),
        words = quoted.join(" "),
    );
    let out = std::process::Command::new("bash").arg("--norc").arg("-c").arg(&program).output().expect("run bash");
    assert!(out.status.success(), "bash failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).filter(|l| !l.is_empty()).collect()
}

#[test]
fn bash_completion_completes_command_words_and_flags() {
    let (code, script, err) = cli(&["completion", "bash"], &[]);
    assert_eq!(code, 0, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("better-compute.bash");
    std::fs::write(&path, &script).unwrap();

    assert_eq!(complete(&path, &["better-compute", "po"]), ["pools"]);
    let top = complete(&path, &["better-compute", "re"]);
    for word in ["reconcile", "reserve", "release", "reservations"] {
        assert!(top.contains(&word.to_owned()), "{word} in {top:?}");
    }
    assert_eq!(complete(&path, &["better-compute", "nodes", "dr"]), ["drain"]);
    assert_eq!(complete(&path, &["better-compute", "join-tokens", "rev"]), ["revoke"]);
    assert_eq!(complete(&path, &["better-compute", "commands", "issue", "--dead"]), ["--deadline"]);
    assert_eq!(complete(&path, &["better-compute", "reserve", "--po"]), ["--pool"]);
    assert_eq!(complete(&path, &["better-compute", "events", "watch", "--si"]), ["--since"]);
    let formats = complete(&path, &["better-compute", "pools", "list", "--format", ""]);
    assert_eq!(formats, ["json", "compact", "table"], "the values of a flag with choices");
    assert_eq!(complete(&path, &["better-compute", "completion", "fi"]), ["fish"]);

    for (shell, marker) in [("zsh", "#compdef better-compute"), ("fish", "complete -c better-compute")] {
        let (code, script, err) = cli(&["completion", shell], &[]);
        assert_eq!(code, 0, "{err}");
        assert!(script.contains(marker), "{shell}: {}", &script[..script.len().min(300)]);
    }
    let (code, _, err) = cli(&["completion", "tcsh"], &[]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn help_json_is_the_whole_manifest() {
    let (code, out, err) = cli(&["help", "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    let manifest = json_of(&out);
    let names: BTreeSet<String> =
        manifest["commands"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap().to_owned()).collect();
    // Every command `--help` lists, no more and no fewer.
    let (code, help, _) = cli(&["--help"], &[]);
    assert_eq!(code, 0);
    let listed: BTreeSet<String> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    assert!(listed.len() >= 20, "{help}");
    assert_eq!(names, listed);
    for expected in ["api", "completion", "help", "reserve", "events", "webhooks", "dev", "audit", "join-tokens", "commands"] {
        assert!(names.contains(expected), "{expected}");
    }

    // Subcommands and flags, with their help, value names, defaults and whether required.
    let find = |list: &Value, name: &str| -> Value {
        list.as_array().unwrap().iter().find(|c| c["name"] == name || c["long"] == name).cloned().unwrap_or(Value::Null)
    };
    let drain = find(&find(&manifest["commands"], "nodes")["commands"], "drain");
    assert_eq!(drain["path"], "better-compute nodes drain");
    let wait = find(&drain["args"], "--wait");
    assert_eq!((wait["default"].clone(), wait["takesValue"].clone()), (json!(["0"]), json!(true)));
    let reserve = find(&manifest["commands"], "reserve");
    let duration = find(&reserve["args"], "--for");
    assert_eq!(duration["required"], true);
    assert_eq!(duration["valueNames"], json!(["DURATION"]));
    assert!(duration["help"].as_str().unwrap().contains("30m"), "{duration}");
    let format = find(&manifest["args"], "--format");
    assert_eq!(format["choices"], json!(["json", "compact", "table"]));
    assert_eq!(find(&manifest["args"], "--url")["env"], "BETTER_COMPUTE_URL");

    // One command's help, as text or JSON; an unknown one is a usage error.
    let (code, out, _) = cli(&["help", "reserve"], &[]);
    assert!(code == 0 && out.contains("--for <DURATION>"), "{out}");
    let (code, out, _) = cli(&["help", "nodes", "drain", "--json"], &[]);
    assert_eq!((code, json_of(&out)["name"].as_str()), (0, Some("drain")));
    let (code, _, err) = cli(&["help", "nodes", "drian"], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("did you mean drain"), "{err}");
}

#[tokio::test]
async fn list_tables_show_chosen_columns_and_json_keeps_raw_fields() {
    let server = Server::dev();
    let pool = server.pool("tables").await;
    let gpu = json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 });
    let (status, node) = server.call("nodes.register", json!({ "poolId": pool, "name": "n1", "gpus": [gpu, gpu] })).await;
    assert_eq!(status, 200, "{node}");
    let (code, out, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h"]);
    assert_eq!(code, 0, "{err}");
    let rsv = json_of(&out)["reservationId"].as_str().unwrap().to_owned();

    let rows = |out: &str| -> Vec<Vec<String>> {
        out.lines().map(|l| l.split_whitespace().map(str::to_owned).collect()).filter(|r: &Vec<String>| !r.is_empty()).collect()
    };
    let (code, out, _) = server.cli(&["reservations", "list"]);
    assert_eq!(code, 0);
    let table = rows(&out);
    assert_eq!(table[0], ["ID", "STATE", "GPUS", "NODE", "AGE", "ENDS"], "{out}");
    let row = &table[1];
    assert_eq!(&row[..4], [rsv.as_str(), "active", "1", node["nodeId"].as_str().unwrap()], "{out}");
    let age = row[4..row.len() - 2].join(" ");
    assert!(age == "now" || age.ends_with("s ago"), "AGE {age:?}: {out}");
    assert_eq!(row[row.len() - 2..], ["in", "59m"], "ENDS: {out}");
    assert!(!out.contains("ten_") && !out.contains("requestSeq"), "only the chosen columns: {out}");

    // --format json is the raw result, every field as the server sent it.
    let (code, out, _) = server.cli(&["reservations", "list", "--format", "json"]);
    assert_eq!(code, 0);
    let item = &json_of(&out)["items"][0];
    assert!(item["endsAtMs"].is_u64() && item["tenantId"].is_string() && item["requestSeq"].is_u64(), "{item}");

    let (_, out, _) = server.cli(&["pools", "list"]);
    assert_eq!(rows(&out)[0], ["ID", "NAME", "LABELS", "MAX", "ARCHIVED", "AGE"], "{out}");
    let (_, out, _) = server.cli(&["nodes", "list"]);
    assert_eq!(rows(&out)[0], ["ID", "NAME", "STATE", "GPUS", "USED", "POOL", "AGE"], "{out}");
    assert!(out.contains("2× H100-SXM5-80GB (80 GiB)") && out.contains("1/2"), "{out}");
    let (_, out, _) = server.cli(&["events", "list"]);
    assert_eq!(rows(&out)[0], ["POSITION", "AGE", "TYPE", "STREAM", "ACTOR"], "{out}");
    let (_, out, _) = server.cli(&["events", "list", "--format", "json"]);
    assert!(json_of(&out)["items"][0]["payload"].is_object(), "{out}");
    let (_, out, _) = server.cli(&["api", "apiKeys.list", "--format", "table"]);
    assert_eq!(rows(&out)[0], ["ID", "NAME", "ACTIONS", "REVOKED", "AGE"], "{out}");
    let (code, out, _) = server.cli(&["webhooks", "create", "--endpoint", "http://127.0.0.1:9/x", "--types", "*"]);
    assert_eq!(code, 0);
    assert!(json_of(&out)["secret"].is_string());
    let (_, out, _) = server.cli(&["webhooks", "list"]);
    assert_eq!(rows(&out)[0], ["ID", "URL", "TYPES", "DESCRIPTION", "AGE"], "{out}");
    let (_, out, _) = server.cli(&["api", "--list"]);
    assert_eq!(rows(&out)[0], ["METHOD", "ACTION", "SUMMARY"], "{out}");
}

#[tokio::test]
async fn watch_since_start_or_zero_replays_from_the_beginning() {
    let server = Server::dev();
    server.pool("replayed").await;
    for since in ["start", "0"] {
        let (code, out, err) = tokio::time::timeout(Duration::from_secs(30), async {
            let env = server.env().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            run(strings(&["events", "watch", "--since", since, "--count", "3"]), env, None).await
        })
        .await
        .expect("the watch ends after --count");
        assert_eq!(code, 0, "{err}");
        let types: Vec<String> = out.lines().map(|l| json_of(l)["type"].as_str().unwrap().to_owned()).collect();
        assert_eq!(types, ["tenant.created", "api_key.created", "pool.created"], "--since {since}");
    }
    let (code, _, err) = server.cli(&["events", "watch", "--since", "yesterday"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--since"), "{err}");
}
