"""The agents' endpoint from outside, with gRPC's own Python clients (tests/tests/health.rs).

Usage: grpc_health_check.py HOST:PORT CA_PEM

Over TLS, trusting CA_PEM (the gateway's self-signed serving certificate) as the only root:
1. grpc.health.v1.Health/Check for the server ("") and for the agents' service, with
   grpcio-health-checking's generated stub;
2. server reflection (grpcio-reflection's ProtoReflectionDescriptorDatabase): the services
   listed, and the agents' service's methods found by name.

Prints one JSON object: {"health": {"": "SERVING", SERVICE: ...}, "services": [...],
"methods": [...]}. Exits 1 with the error on stderr if a call fails.
"""

import json
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

AGENT_SERVICE = "bettercompute.agent.v1.Agent"
TIMEOUT_S = 10


def main() -> int:
    target, ca_path = sys.argv[1], sys.argv[2]
    with open(ca_path, "rb") as f:
        root = f.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=root)
    # The certificate names localhost and the loopback addresses.
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(target, credentials, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        statuses = {}
        for service in ("", AGENT_SERVICE):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
            statuses[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        reflection = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(reflection.get_services())
        descriptor = reflection.FindFileContainingSymbol(AGENT_SERVICE)
        methods = sorted(
            m.name for s in descriptor.service if f"{descriptor.package}.{s.name}" == AGENT_SERVICE for m in s.method
        )
    print(json.dumps({"health": statuses, "services": services, "methods": methods}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as e:
        print(f"{e.code()}: {e.details()}", file=sys.stderr)
        sys.exit(1)
