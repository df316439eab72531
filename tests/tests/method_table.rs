//! One method table: the router, `better-compute api --list` and the served OpenAPI document
//! name the same methods with the same actions, and every documented request schema is the one
//! the router enforces (an unknown field is refused by each method).

use std::collections::BTreeMap;

use bc_tests::{Server, json};
use serde_json::{Value, json};

#[tokio::test]
async fn router_api_list_and_openapi_hold_the_same_methods_actions_and_schemas() {
    let server = Server::dev();
    let (code, out, err) = server.cli(&["api", "--list", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let listed: BTreeMap<String, String> = json(&out)["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|m| (m["method"].as_str().unwrap().to_owned(), m["action"].as_str().unwrap().to_owned()))
        .collect();
    assert!(listed.len() >= 41, "{listed:?}");

    let doc: Value =
        server.http.get(format!("{}/api/compute/openapi.json", server.url)).send().await.unwrap().json().await.unwrap();
    let documented: BTreeMap<String, String> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(path, item)| {
            let name = path.strip_prefix("/api/compute/").expect("every path is a method").to_owned();
            let action = match &item["post"]["x-action"] {
                Value::Null => "(public)".to_owned(),
                Value::String(a) => a.clone(),
                other => panic!("{name}: x-action {other}"),
            };
            (name, action)
        })
        .collect();
    assert_eq!(listed, documented, "api --list and the OpenAPI document name the same methods with the same actions");

    // The checked-in document is the served one.
    let checked_in: Value =
        serde_json::from_str(include_str!("../../gateway/openapi.json")).expect("gateway/openapi.json is JSON");
    assert_eq!(checked_in, doc, "the served document is gateway/openapi.json");

    for (name, action) in &listed {
        let post = &doc["paths"][format!("/api/compute/{name}")]["post"];
        let schema_ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str().unwrap_or_default();
        let schema = &doc["components"]["schemas"][schema_ref.rsplit('/').next().unwrap_or_default()];
        assert_eq!(schema["additionalProperties"], false, "{name}: the request schema refuses unknown fields");
        // The router knows the method: without a token a protected one is UNAUTHENTICATED, not
        // NOT_FOUND; with one, an unknown field is refused by the schema's own type.
        let (status, body) = server.call_as("", name, json!({}), None).await;
        if action == "(public)" {
            assert_eq!(status, 200, "{name} is public: {body}");
        } else {
            assert_eq!(status, 401, "{name} asks for a token: {body}");
            assert_eq!(body["code"], "UNAUTHENTICATED");
        }
        let (status, body) = server.call(name, json!({ "notAField": 1 })).await;
        assert_eq!(status, 400, "{name} refuses an unknown field: {body}");
        assert!(body["message"].as_str().unwrap().contains("unknown field"), "{name}: {body}");
        for status in ["200", "400", "404", "409", "413", "500", "503"] {
            assert!(post["responses"][status].is_object(), "{name} documents {status}");
        }
    }
    // A name not in the table is NOT_FOUND, with the nearest method.
    let (status, body) = server.call("pools.lsit", json!({})).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["details"]["didYouMean"], "pools.list");
}
