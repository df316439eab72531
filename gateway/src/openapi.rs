//! The OpenAPI 3.1 document of the API, served at `GET /api/compute/openapi.json`. Each path's
//! request schema is generated (schemars) from the very type its handler parses
//! (`methods::input_schema`), so the document cannot describe fields the server does not take.

use serde_json::{Map, Value, json};

use crate::methods::{METHODS, input_schema};

pub fn document() -> Value {
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    let mut paths = Map::new();
    for method in METHODS {
        let input = input_schema(method.name, &mut generator).expect("every method has an input schema");
        let security = match method.action {
            None => json!([]),
            Some(_) => json!([{ "bearer": [] }]),
        };
        let (group, _) = method.name.split_once('.').unwrap_or((method.name, ""));
        paths.insert(
            format!("/api/compute/{}", method.name),
            json!({
                "post": {
                    "operationId": method.name,
                    "summary": method.summary,
                    "tags": [group],
                    "security": security,
                    "x-action": method.action,
                    "parameters": [{
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": false,
                        "schema": { "type": "string", "maxLength": crate::IDEMPOTENCY_KEY_BYTES_MAX },
                        "description": "a retry with the same key and body returns the first result and appends nothing",
                    }],
                    "requestBody": { "required": true, "content": { "application/json": { "schema": input } } },
                    "responses": {
                        "200": { "description": "the result", "content": { "application/json": { "schema": { "type": "object" } } } },
                        "default": {
                            "description": "an error",
                            "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } },
                        },
                    },
                }
            }),
        );
    }
    let mut schemas: Map<String, Value> = generator.take_definitions(true).into_iter().collect();
    schemas.insert(
        "Error".into(),
        json!({
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": { "type": "string", "description": "a stable code: INVALID_ARGUMENT, NOT_FOUND, CONFLICT, QUOTA_EXCEEDED, …" },
                "message": { "type": "string" },
                "details": { "type": "object" },
            },
        }),
    );
    json!({
        "openapi": "3.1.0",
        "info": { "title": "Better Compute", "version": env!("CARGO_PKG_VERSION") },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer", "description": "an API key, KEY_ID.SECRET" } },
        },
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_method_is_documented_with_its_input() {
        let doc = super::document();
        for m in crate::methods::METHODS {
            let path = &doc["paths"][format!("/api/compute/{}", m.name)]["post"];
            assert_eq!(path["operationId"], m.name);
            assert!(path["requestBody"]["content"]["application/json"]["schema"].is_object(), "{}", m.name);
        }
        let create = &doc["components"]["schemas"]["AskInput"];
        assert_eq!(create["additionalProperties"], false, "unknown fields are refused: {create}");
        assert!(create["properties"]["durationS"].is_object() && create["properties"]["poolId"].is_object(), "{create}");
    }
}
