//! Sites and projects end to end (issue 56): the real `better-compute dev` and CLI. A site is
//! made; a pool names it; the site's delete is refused `INVALID_STATE` naming the pool, and
//! nothing is appended; the pool's archive lets it go. A project is made; a reservation is made
//! in it and carries it; the project is archived and a new reservation in it is refused
//! `INVALID_STATE`, nothing appended, while one in no project still goes. Another tenant's
//! project is not found, as from that tenant it does not exist.

use bc_tests::Server;
use serde_json::{Value, json};

/// The number of events of the server's tenant, from `events.list` (page by page).
async fn event_count(server: &Server) -> usize {
    let mut count = 0;
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let (status, page) = server.call("events.list", body).await;
        assert_eq!(status, 200, "{page}");
        count += page["items"].as_array().unwrap().len();
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return count,
        }
    }
}

fn ok(out: (i32, String, String)) -> Value {
    let (code, out, err) = out;
    assert_eq!(code, 0, "{err}");
    bc_tests::json(&out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_site_stays_and_an_archived_project_takes_no_new_reservation() {
    let server = Server::dev();

    // A site, and a pool at it.
    let site = ok(server.cli(&["sites", "create", "--name", "fra1", "--region", "eu-central", "--label", "dc=fra"]));
    let site_id = site["siteId"].as_str().unwrap().to_owned();
    assert_eq!((site["name"].as_str(), site["region"].as_str()), (Some("fra1"), Some("eu-central")), "{site}");
    assert_eq!(site["labels"], json!({ "dc": "fra" }));
    let pool = ok(server.cli(&["pools", "create", "--name", "gpu-fra", "--site", &site_id]));
    let pool_id = pool["poolId"].as_str().unwrap().to_owned();
    assert_eq!(pool["siteId"], json!(site_id), "{pool}");
    // A site that does not exist is not named.
    let (status, body) =
        server.call("pools.create", json!({ "name": "nowhere", "siteId": "site_01arz3ndektsv4rrffq69g5fav" })).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "{body}");

    // The site's name and labels change in place; its region does not.
    let updated = ok(server.cli(&["sites", "update", &site_id, "--name", "fra-1", "--label", "dc=fra", "--label", "tier=a"]));
    assert_eq!((updated["name"].as_str(), updated["region"].as_str()), (Some("fra-1"), Some("eu-central")), "{updated}");
    let (status, body) = server.call("sites.update", json!({ "siteId": site_id, "region": "us-east" })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "no region in an update: {body}");
    let listed = ok(server.cli(&["sites", "list", "--format", "json"]));
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(1), "{listed}");

    // Named by the pool: the delete is refused, naming it, and nothing is appended.
    let before = event_count(&server).await;
    let (code, _, err) = server.cli(&["sites", "delete", &site_id]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&format!("pool/{pool_id}")), "{err}");
    assert_eq!(event_count(&server).await, before, "a refused delete appends nothing");
    // Once the pool is archived, nothing live names it: it goes.
    let (status, body) = server.call("pools.archive", json!({ "poolId": pool_id })).await;
    assert_eq!(status, 200, "{body}");
    let deleted = ok(server.cli(&["sites", "delete", &site_id]));
    assert_eq!(deleted["deleted"], true, "{deleted}");
    let (code, _, err) = server.cli(&["sites", "get", &site_id]);
    assert_ne!(code, 0);
    assert!(err.contains("NOT_FOUND"), "{err}");

    // A project, and a reservation in it.
    let pool = server.pool("gpus").await;
    server.h100_nodes(&pool, 1).await;
    let project = ok(server.cli(&["projects", "create", "--name", "training", "--description", "the big run"]));
    let project_id = project["projectId"].as_str().unwrap().to_owned();
    assert_eq!(project["archived"], false, "{project}");
    let rsv =
        ok(server.cli(&["reservations", "create", "--pool", &pool, "--gpus", "1", "--for", "1h", "--project", &project_id]));
    assert_eq!(rsv["projectId"], json!(project_id), "{rsv}");
    assert_eq!(rsv["state"], "active", "{rsv}");
    let (status, got) = server.call("reservations.get", json!({ "reservationId": rsv["reservationId"] })).await;
    assert_eq!((status, &got["projectId"]), (200, &json!(project_id)), "{got}");

    // Archived: it takes no new reservation, and a refusal appends nothing.
    let archived = ok(server.cli(&["projects", "archive", &project_id]));
    assert_eq!(archived["archived"], true, "{archived}");
    let before = event_count(&server).await;
    let (code, _, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h", "--project", &project_id]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&project_id), "{err}");
    assert_eq!(event_count(&server).await, before, "a refused reservation appends nothing");
    // What was made in it keeps naming it; a reservation in no project still goes.
    let (_, got) = server.call("reservations.get", json!({ "reservationId": rsv["reservationId"] })).await;
    assert_eq!(got["projectId"], json!(project_id), "{got}");
    let plain = ok(server.cli(&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h"]));
    assert!(plain.get("projectId").is_none(), "{plain}");
    // reservations list --project: only the one made in it; the filter needs a project's id.
    let listed = ok(server.cli(&["reservations", "list", "--project", &project_id, "--format", "json"]));
    let ids: Vec<&str> = listed["items"].as_array().unwrap().iter().map(|r| r["reservationId"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![rsv["reservationId"].as_str().unwrap()], "{listed}");
    let all_rsv = ok(server.cli(&["reservations", "list", "--format", "json"]));
    assert_eq!(all_rsv["items"].as_array().map(Vec::len), Some(2), "{all_rsv}");
    let (code, _, err) = server.cli(&["reservations", "list", "--project", "training"]);
    assert_eq!(code, 2, "a name for an id is a usage error: {err}");
    let (status, body) = server.call("reservations.list", json!({ "projectId": "rsv_01arz3ndektsv4rrffq69g5fav" })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}");
    // Listed only with --include-archived.
    let live = ok(server.cli(&["projects", "list", "--format", "json"]));
    assert_eq!(live["items"].as_array().map(Vec::len), Some(0), "{live}");
    let all = ok(server.cli(&["projects", "list", "--include-archived", "--format", "json"]));
    assert_eq!(all["items"][0]["projectId"], json!(project_id), "{all}");
    // A malformed project id is a usage error before anything is sent.
    let (code, _, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h", "--project", "training"]);
    assert_eq!(code, 2, "{err}");

    // Another tenant's project does not exist for this one.
    let other = server.tenant("other").await;
    let (status, theirs) = server.call("projects.create", json!({ "tenantId": other, "name": "theirs" })).await;
    assert_eq!(status, 200, "{theirs}");
    let (status, body) = server
        .call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 60, "projectId": theirs["projectId"] }))
        .await;
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "{body}");
}

/// `metal enroll` of a machine with `--bmc-insecure` into `pool`, at `site` when given.
fn enroll(server: &Server, pool: &str, name: &str, site: Option<&str>, password_file: &std::path::Path) -> (i32, String, String) {
    // Nothing listens at this address: enrollment only records the machine.
    let address = format!("https://127.0.0.1:{}", bc_tests::free_port());
    let mut args = vec![
        "metal",
        "enroll",
        "--pool",
        pool,
        "--name",
        name,
        "--bmc-address",
        &address,
        "--bmc-username",
        "admin",
        "--bmc-password-file",
        password_file.to_str().unwrap(),
        "--bmc-insecure",
    ];
    if let Some(site) = site {
        args.extend(["--site", site]);
    }
    server.cli(&args)
}

/// A bare-metal machine names its site: the one it is enrolled at, or its pool's. One other than
/// its pool's is refused `INVALID_STATE`, a site of no one `NOT_FOUND`, each appending nothing;
/// the site's delete is refused while the machine names it, naming `metal/node_…`, even once
/// the machine's pool is archived (a machine's site does not go with its pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_names_its_site_and_holds_it_against_a_delete() {
    let server = Server::dev_with(&["--bmc-allow-network", "127.0.0.1/32"]);
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("bmc-password");
    std::fs::write(&password_file, "not-a-real-password\n").unwrap();
    let site = |name: &str| {
        let site = ok(server.cli(&["sites", "create", "--name", name, "--region", "eu-central"]));
        site["siteId"].as_str().unwrap().to_owned()
    };
    let (fra, ams) = (site("fra1"), site("ams1"));
    let at_fra =
        ok(server.cli(&["pools", "create", "--name", "metal-fra", "--site", &fra]))["poolId"].as_str().unwrap().to_owned();
    let anywhere = ok(server.cli(&["pools", "create", "--name", "metal-any"]))["poolId"].as_str().unwrap().to_owned();

    // Into a pool at a site: the machine takes the pool's; another site is refused.
    let taken = ok(enroll(&server, &at_fra, "m1", None, &password_file));
    assert_eq!(taken["siteId"], json!(fra), "{taken}");
    let before = event_count(&server).await;
    let (code, _, err) = enroll(&server, &at_fra, "m2", Some(&ams), &password_file);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&fra) && err.contains(&ams), "{err}");
    let (code, _, err) = enroll(&server, &anywhere, "m2", Some("site_01arz3ndektsv4rrffq69g5fav"), &password_file);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("NOT_FOUND"), "{err}");
    assert_eq!(event_count(&server).await, before, "a refused enrollment appends nothing");
    let (code, _, err) = enroll(&server, &anywhere, "m2", Some("fra1"), &password_file);
    assert_eq!(code, 2, "a site is named by its id: {err}");

    // Into a pool at none: the site it names.
    let named = ok(enroll(&server, &anywhere, "m2", Some(&ams), &password_file));
    assert_eq!(named["siteId"], json!(ams), "{named}");
    let got = ok(server.cli(&["metal", "get", named["nodeId"].as_str().unwrap()]));
    assert_eq!(got["siteId"], json!(ams), "{got}");

    // The machines hold their sites: the deletes are refused, naming them, appending nothing.
    let before = event_count(&server).await;
    for (site, machine) in [(&ams, &named), (&fra, &taken)] {
        let (code, _, err) = server.cli(&["sites", "delete", site]);
        assert_eq!(code, 1, "{err}");
        let referrer = format!("metal/{}", machine["nodeId"].as_str().unwrap());
        assert!(err.contains("INVALID_STATE") && err.contains(&referrer), "{err}");
    }
    let (status, body) = server.call("pools.archive", json!({ "poolId": at_fra })).await;
    assert_eq!(status, 200, "{body}");
    let (code, _, err) = server.cli(&["sites", "delete", &fra]);
    assert_eq!(code, 1, "its machine holds the site once its pool is archived: {err}");
    assert!(err.contains(&format!("metal/{}", taken["nodeId"].as_str().unwrap())) && !err.contains("pool/"), "{err}");
    assert_eq!(event_count(&server).await, before + 1, "only the pool's archive was appended");
    // A site nothing names still goes.
    let spare = site("spare");
    assert_eq!(ok(server.cli(&["sites", "delete", &spare]))["deleted"], true);
}

/// `pools update` and `pools archive` from the command line: an update changes only what it
/// names and moves the version; a stale `--if-version` is `CONFLICT` and appends nothing; an
/// update with nothing to change is a usage error before anything is sent; an archived pool
/// leaves `pools list` (not `--include-archived`), archiving it again appends nothing, and it
/// takes no update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_are_updated_and_archived_from_the_command_line() {
    let server = Server::dev();
    let pool = ok(server.cli(&["pools", "create", "--name", "gpu-a", "--description", "first", "--label", "tier=a"]));
    let pool_id = pool["poolId"].as_str().unwrap().to_owned();
    let version = pool["version"].as_u64().unwrap();

    let updated = ok(server.cli(&[
        "pools",
        "update",
        &pool_id,
        "--name",
        "gpu-b",
        "--label",
        "tier=b",
        "--label",
        "zone=1",
        "--max-reservation",
        "8h",
        "--if-version",
        &version.to_string(),
    ]));
    assert_eq!((updated["name"].as_str(), updated["description"].as_str()), (Some("gpu-b"), Some("first")), "{updated}");
    assert_eq!(updated["labels"], json!({ "tier": "b", "zone": "1" }), "{updated}");
    assert_eq!(updated["maxReservationS"], 8 * 3600, "{updated}");
    assert!(updated["version"].as_u64().unwrap() > version, "{updated}");

    let before = event_count(&server).await;
    let (code, _, err) = server.cli(&["pools", "update", &pool_id, "--description", "x", "--if-version", &version.to_string()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("CONFLICT"), "a stale version: {err}");
    let (code, _, err) = server.cli(&["pools", "update", &pool_id]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nothing to update"), "{err}");
    let (code, _, err) = server.cli(&["pools", "update", &pool_id, "--max-reservation", "10s"]);
    assert_eq!(code, 2, "under a minute: {err}");
    let (code, _, err) = server.cli(&["pools", "update", "gpu-b", "--name", "c"]);
    assert_eq!(code, 2, "a pool is named by its id: {err}");
    assert_eq!(event_count(&server).await, before, "refusals append nothing");
    let cleared = ok(server.cli(&["pools", "update", &pool_id, "--clear-labels"]));
    assert_eq!(cleared["labels"], json!({}), "{cleared}");

    let archived = ok(server.cli(&["pools", "archive", &pool_id]));
    assert_eq!(archived["archived"], true, "{archived}");
    let listed = ok(server.cli(&["pools", "list", "--format", "json"]));
    assert!(!listed.to_string().contains(&pool_id), "{listed}");
    let all = ok(server.cli(&["pools", "list", "--include-archived", "--format", "json"]));
    assert!(all.to_string().contains(&pool_id), "{all}");
    let before = event_count(&server).await;
    let again = ok(server.cli(&["pools", "archive", &pool_id]));
    assert_eq!((again["archived"].as_bool(), again["version"].as_u64()), (Some(true), archived["version"].as_u64()));
    let (code, _, err) = server.cli(&["pools", "update", &pool_id, "--name", "gpu-c"]);
    assert_eq!(code, 1, "an archived pool takes no update: {err}");
    assert!(err.contains("CONFLICT"), "{err}");
    assert_eq!(event_count(&server).await, before, "archiving again appends nothing");
}
