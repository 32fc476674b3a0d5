"""A local stand-in for the W&B server, enough for `wandb sync` to upload offline runs to it.

It answers the GraphQL operations a sync sends (by name) and keeps what arrives on each run's
file stream: history rows by line, as the server stores them. `RunResumeStatus` reports a run's
line count, last step and summary as the server does, so a resumed run's later folders are
numbered on from the earlier ones by W&B's own client code. Anything else gets an empty answer.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ENTITY, PROJECT_ID = "fake-entity", "fake-project-id"


class FakeWandbServer:
    """`with FakeWandbServer() as server:` serves on a free local port (`server.url`)."""

    def __init__(self):
        self.runs: dict[str, dict] = {}  # run id -> {"history": {line: row}, "summary": {...}}
        self.operations: list[str] = []  # GraphQL operation names, in order
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> FakeWandbServer:
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()

    def history(self, run_id: str) -> list[dict]:
        """The run's history rows in line order (what the W&B UI charts)."""
        lines = self.runs[run_id]["history"]
        assert sorted(lines) == list(range(len(lines))), f"gaps in the history lines: {sorted(lines)}"
        return [lines[i] for i in range(len(lines))]

    def _bucket(self, name: str) -> dict | None:
        run = self.runs.get(name)
        if run is None:
            return None
        lines = run["history"]
        tail = [json.dumps(lines[max(lines)])] if lines else []
        return {
            "id": f"storage-{name}",
            "name": name,
            "displayName": name,
            "historyLineCount": len(lines),
            "eventsLineCount": 0,
            "logLineCount": 0,
            "historyTail": json.dumps(tail),
            "eventsTail": "[]",
            "summaryMetrics": json.dumps(run["summary"]),
            "config": "{}",
            "wandbConfig": json.dumps({"t": {}}),  # "t" present: the run has started (W&B's test)
            "tags": [],
            "notes": None,
            "project": {"id": PROJECT_ID, "name": run["project"], "entity": {"id": "e", "name": ENTITY}},
        }

    def answer(self, path: str, request: dict, port: int) -> dict:
        """The reply to one POST (GraphQL or file stream); records what it carries."""
        with self._lock:
            if path.endswith("/file_stream"):
                run = self.runs[path.split("/")[-2]]
                for name, chunk in request.get("files", {}).items():
                    rows = [json.loads(line) for line in chunk["content"]]
                    if name == "wandb-history.jsonl":
                        run["history"].update({chunk["offset"] + i: row for i, row in enumerate(rows)})
                    elif name == "wandb-summary.json":
                        for row in rows:
                            run["summary"].update(row)
                return {"exitcode": None, "limits": {}}
            if path != "/graphql":  # the client's telemetry
                return {}
            op, v = request.get("operationName"), request.get("variables") or {}
            self.operations.append(op)
            if op == "UpsertBucket":
                self.runs.setdefault(v["name"], {"history": {}, "summary": {}, "project": v.get("project")})
                return {"data": {"upsertBucket": {"bucket": self._bucket(v["name"]), "inserted": True}}}
            if op == "RunResumeStatus":
                model = {"id": PROJECT_ID, "name": v.get("project"), "entity": {"id": "e", "name": ENTITY}}
                return {"data": {"model": {**model, "bucket": self._bucket(v["name"])}}}
            if op == "CreateRunFiles":
                files = [{"name": f, "uploadUrl": f"http://127.0.0.1:{port}/upload/{f}"} for f in v["files"]]
                return {"data": {"createRunFiles": {"runID": "r", "uploadHeaders": [], "files": files}}}
            if op == "ServerFeaturesQuery":
                return {"data": {"serverInfo": {"features": []}}}
            if op == "CreateArtifact":  # as one the server holds already: nothing to upload
                done = {"id": "artifact", "state": "COMMITTED", "artifactSequence": {"latestArtifact": None}}
                return {"data": {"createArtifact": {"artifact": done}}}
            return {"data": {}}


def _handler(server: FakeWandbServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_PUT(self) -> None:  # file uploads: accepted, not kept
            self._body()
            self._reply({})

        def do_GET(self) -> None:
            self._reply({})

        def do_POST(self) -> None:
            body = self._body()
            try:
                request = json.loads(body)
            except ValueError:  # telemetry and other binary posts
                request = {}
            if not isinstance(request, dict):
                request = {}
            self._reply(server.answer(self.path, request, self.server.server_address[1]))

    return Handler
