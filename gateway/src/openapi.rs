//! The OpenAPI 3.1 document of the API, served at `GET /api/compute/openapi.json` and checked
//! in as `gateway/openapi.json` (a test fails when the two differ; `BC_BLESS=1 cargo test -p
//! bc-gateway openapi` writes the file anew).
//!
//! Everything in it is read from the method table ([`crate::api::table`]): each path's request
//! schema is generated (schemars) from the very type its handler parses, and its `200` schema
//! from the view it answers with, so the document cannot describe fields the server does not
//! take or give. Every error status a method can answer is listed with the error envelope and
//! the codes that status carries.

use bc_core::ErrorCode;
use serde_json::{Map, Value, json};

use crate::api::{Access, table};
use crate::error::status_of;

/// Every error code, for the envelope's schema.
const ERROR_CODES: &[ErrorCode] = &[
    ErrorCode::InvalidArgument,
    ErrorCode::NotFound,
    ErrorCode::Conflict,
    ErrorCode::InvalidState,
    ErrorCode::IdempotencyConflict,
    ErrorCode::AlreadyExists,
    ErrorCode::Unauthenticated,
    ErrorCode::AccessDenied,
    ErrorCode::QuotaExceeded,
    ErrorCode::RateLimited,
    ErrorCode::PayloadTooLarge,
    ErrorCode::Unavailable,
    ErrorCode::Unsupported,
    ErrorCode::BatchRequired,
    ErrorCode::PlanBlocked,
    ErrorCode::ConfigDrift,
    ErrorCode::Corrupt,
    ErrorCode::Internal,
];

/// The statuses an error can have, with the envelope schema of each (its codes).
fn error_responses() -> (Map<String, Value>, Map<String, Value>) {
    let mut by_status: std::collections::BTreeMap<u16, Vec<&str>> = Default::default();
    for code in ERROR_CODES {
        by_status.entry(status_of(*code).as_u16()).or_default().push(code.as_str());
    }
    let mut schemas = Map::new();
    let mut responses = Map::new();
    for (status, codes) in by_status {
        let name = format!("Error{status}");
        schemas.insert(
            name.clone(),
            json!({
                "type": "object",
                "required": ["code", "message", "details"],
                "properties": {
                    "code": { "type": "string", "enum": codes },
                    "message": { "type": "string", "description": "what failed, for a person" },
                    "details": {
                        "type": "object",
                        "description": "structured detail: `hint` (what to do next), `didYouMean` (an unknown method), …",
                    },
                },
            }),
        );
        let mut response = json!({
            "description": format!("an error: {}", codes.join(", ")),
            "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{name}") } } },
        });
        if status == 429 {
            response["headers"] = json!({ "Retry-After": {
                "description": "whole seconds until the key's and the tenant's buckets hold a token again (`details.retryAfterMs` in milliseconds)",
                "schema": { "type": "integer", "minimum": 1 },
            } });
        }
        responses.insert(status.to_string(), response);
    }
    (schemas, responses)
}

pub fn document() -> Value {
    // Inputs as the server reads them (a field with a default is optional), outputs as it
    // writes them (every field it always writes is required), in one namespace of components.
    let settings = |contract| {
        schemars::generate::SchemaSettings::draft2020_12().with(|s| {
            s.definitions_path = "/components/schemas".into();
            s.meta_schema = None;
            s.contract = contract;
        })
    };
    let mut generator = settings(schemars::generate::Contract::Deserialize).into_generator();
    let mut out_generator = settings(schemars::generate::Contract::Serialize).into_generator();
    let (error_schemas, error_responses) = error_responses();
    let mut paths = Map::new();
    for method in table() {
        let input = (method.input)(&mut generator);
        let output = (method.output)(&mut out_generator);
        let body_required = {
            let name = input.get("$ref").and_then(Value::as_str).and_then(|r| r.rsplit('/').next()).unwrap_or_default();
            let definitions = generator.definitions();
            let schema = definitions.get(name).unwrap_or(input.as_value());
            schema.get("required").and_then(Value::as_array).is_some_and(|r| !r.is_empty())
        };
        let security = match method.access {
            Access::Public => json!([]),
            _ => json!([{ "bearer": [] }]),
        };
        let mut responses = Map::new();
        responses.insert(
            "200".into(),
            json!({ "description": "the result", "content": { "application/json": { "schema": output } } }),
        );
        for (status, response) in &error_responses {
            // A public method never asks for a token, so it is never refused one, nor counted
            // against a key's rate.
            let auth_status = matches!(status.as_str(), "401" | "403" | "429");
            if method.access == Access::Public && auth_status {
                continue;
            }
            responses.insert(status.clone(), response.clone());
        }
        let mut operation = json!({
            "post": {
                "operationId": method.name,
                "summary": method.summary,
                "tags": [method.group()],
                "security": security,
                "x-action": method.access.action(),
                "parameters": [{
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": false,
                    "schema": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": crate::IDEMPOTENCY_KEY_BYTES_MAX,
                        "pattern": "^[!-~]+$",
                    },
                    "description": "a retry with the same key and body returns the first result and appends nothing",
                }, {
                    "name": "X-Request-Id",
                    "in": "header",
                    "required": false,
                    // Any value is taken (one not of the kept form is replaced, never
                    // refused): an empty schema, so no value is documented as refused.
                    "schema": {},
                    "description": format!(
                        "the request's id, echoed in the answer's X-Request-Id and carried as the events' correlation; kept when it is 1 to {} of A-Z a-z 0-9 . _ : -, else replaced by one the server makes (never refused)",
                        crate::rpc::REQUEST_ID_BYTES_MAX
                    ),
                }],
                // An empty body is `{}`: it may be left out when no field is required.
                "requestBody": {
                    "required": body_required,
                    "content": { "application/json": { "schema": input } },
                },
                "responses": responses,
            }
        });
        // A method that refuses an Idempotency-Key documents none.
        if crate::api::IDEMPOTENCY_KEY_REFUSED.contains(&method.name) {
            operation["post"]["parameters"].as_array_mut().expect("parameters").remove(0);
        }
        paths.insert(format!("/api/compute/{}", method.name), operation);
    }
    let mut schemas: Map<String, Value> = generator.take_definitions(true).into_iter().collect();
    for (name, schema) in out_generator.take_definitions(true) {
        if let Some(input) = schemas.get(&name) {
            assert_eq!(input, &schema, "{name} names an input and an output schema that differ");
        }
        schemas.insert(name, schema);
    }
    schemas.extend(error_schemas);
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Better Compute",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "An event-sourced control plane for GPU capacity. Every method is POST /api/compute/GROUP.METHOD with a JSON body; errors are {code, message, details}.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer", "description": "an API key, KEY_ID.SECRET" } },
        },
    })
}

/// The document as checked in: pretty JSON with a final newline.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).expect("the document is JSON");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_method_is_documented_with_its_input_and_output() {
        let doc = super::document();
        for m in crate::api::table() {
            let path = &doc["paths"][format!("/api/compute/{}", m.name)]["post"];
            assert_eq!(path["operationId"], m.name);
            assert!(path["requestBody"]["content"]["application/json"]["schema"].is_object(), "{}", m.name);
            assert!(path["responses"]["200"]["content"]["application/json"]["schema"].is_object(), "{}", m.name);
            assert!(path["responses"]["400"].is_object(), "{}", m.name);
        }
        let create = &doc["components"]["schemas"]["AskInput"];
        assert_eq!(create["additionalProperties"], false, "unknown fields are refused: {create}");
        assert!(create["properties"]["durationS"].is_object() && create["properties"]["poolId"].is_object(), "{create}");
        let pool_id = &doc["components"]["schemas"]["PoolIdText"];
        assert_eq!(pool_id["pattern"], "^pool_[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}$", "{pool_id}");
    }

    /// The checked-in document is the one the code serves.
    #[test]
    fn openapi_document_is_checked_in() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
        let served = super::document_text();
        if std::env::var_os("BC_BLESS").is_some() {
            std::fs::write(&path, &served).unwrap();
        }
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == served,
            "gateway/openapi.json differs from the document the code serves; \
             if the change is intended, run `BC_BLESS=1 cargo test -p bc-gateway openapi` and commit the file"
        );
    }
}
