"""A tunnel client written from schema/TUNNELS.md alone, on Python's `websockets` (PyPI): opens a
console on a node, runs one command in its shell, prints what the terminal printed, and exits
with the command's exit status (255 when the tunnel broke), as the spec's channel 3 says.

    BETTER_COMPUTE_TOKEN=... python tunnel_client.py --url http://127.0.0.1:7070 --node node_... \
        --command 'echo hi; exit 3'
"""

import argparse
import asyncio
import json
import os
import sys
import urllib.request

from websockets.asyncio.client import connect

STDIN, STDOUT, STDERR, STATUS, RESIZE = 0, 1, 2, 3, 4


def open_ticket(url, token, node):
    request = urllib.request.Request(
        url.rstrip("/") + "/api/compute/tunnels.open",
        data=json.dumps({"op": "console", "nodeId": node}).encode(),
        headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def exit_status(status):
    """The exit status a Kubernetes Status on channel 3 carries (255: the tunnel failed)."""
    if status.get("status") == "Success":
        return 0
    for cause in status.get("details", {}).get("causes", []):
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    return 255


async def run(url, token, node, command):
    ticket = open_ticket(url, token, node)
    ws_url = url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1) + ticket["url"]
    async with connect(
        ws_url,
        subprotocols=["v5.channel.k8s.io"],
        additional_headers={"Authorization": "Bearer " + token},
    ) as socket:
        assert socket.subprotocol == "v5.channel.k8s.io", socket.subprotocol
        await socket.send(bytes([RESIZE]) + json.dumps({"Width": 120, "Height": 40}).encode())
        await socket.send(bytes([STDIN]) + (command + "\r").encode())
        async for message in socket:
            if isinstance(message, str) or not message:
                continue
            channel, payload = message[0], message[1:]
            if channel in (STDOUT, STDERR):
                sys.stdout.write(payload.decode("utf-8", "replace"))
            elif channel == STATUS:
                status = json.loads(payload)
                print("status:", json.dumps(status), file=sys.stderr)
                return exit_status(status)
    print("the tunnel closed without a status:", socket.close_code, socket.close_reason, file=sys.stderr)
    return 255


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--command", required=True)
    args = parser.parse_args()
    status = asyncio.run(run(args.url, os.environ["BETTER_COMPUTE_TOKEN"], args.node, args.command))
    sys.stdout.flush()
    sys.exit(status)


if __name__ == "__main__":
    main()
