"""SGLang 0.5.23 findings N1-N7 of issue 24, each against the real client over loopback HTTP (the embedded
double, or a stdlib server answering as SGLang does where the double cannot take that shape)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.http_client import RetryPolicy, ServerError, SGLangClient

FAST = RetryPolicy(max_attempts=3, backoff_s=0.01)


class _Scripted:
    """A loopback HTTP server answering ``answers[path] = (status, json)`` and counting the calls per path."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.calls.append(self.path)
                status, payload = outer.answers.get(self.path, (404, {"detail": "Not Found"}))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(answers):
        servers.append(_Scripted(answers))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


# ---- N7: 5xx retried only for idempotent calls --------------------------------------------------------------

def test_n7_a_5xx_is_not_retried_for_group_join_or_bucket_announce(scripted):
    err = (500, {"error": {"message": "boom"}})
    server = scripted({"/init_weights_update_group": err, "/update_weights_from_distributed": err,
                       "/server_info": err})
    client = SGLangClient(server.url, retry=FAST)
    with pytest.raises(ServerError, match="boom"):
        client.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g")
    assert server.calls.count("/init_weights_update_group") == 1  # joined once: never twice
    with pytest.raises(ServerError, match="boom"):
        client.update_weights_from_distributed([("w", torch.zeros(2))], "g")
    assert server.calls.count("/update_weights_from_distributed") == 1
    with pytest.raises(Exception, match="failed after 3 attempt"):  # an idempotent read is still retried
        client.server_info()
    assert server.calls.count("/server_info") == 3


# ---- N6: pipeline-parallel servers cannot join the weight group --------------------------------------------

def test_n6_a_pp_server_is_refused_before_any_rank_joins(scripted):
    ok = (200, {"success": True, "message": "ok"})
    tp = scripted({"/server_info": (200, {"tp_size": 2, "pp_size": 1}), "/init_weights_update_group": ok})
    pp = scripted({"/server_info": (200, {"tp_size": 2, "pp_size": 2}), "/init_weights_update_group": ok})
    engine = RemoteEngine([SGLangClient(tp.url, retry=FAST), SGLangClient(pp.url, retry=FAST)],
                          weight_transport="distributed")
    try:
        with pytest.raises(ValueError, match=rf"{pp.url} reports pp_size=2.*--pp-size 1"):
            engine.init_weight_sync("127.0.0.1", 0, timeout_s=5)
        assert "/init_weights_update_group" not in tp.calls + pp.calls
    finally:
        engine.shutdown()
