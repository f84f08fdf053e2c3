"""Is a stack ready to serve? Its gateway's `/ready` (services/gateway/readiness.py) says so: 200 only
when every pool behind the gateway has a live registered worker. `/health` is liveness only: it answers
200 while workers are still loading, so the stack waiters (epd chaos, the bench's local stack) ask /ready."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def gateway_not_ready(url: str) -> dict[str, str]:
    """GET {url}/ready: {} when 200, else pool -> why it is not ready ("gateway" when it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/ready", timeout=2) as reply:
            return {} if reply.status == 200 else {"gateway": f"/ready answered {reply.status}"}
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read())
            return {pool: body["pools"][pool] for pool in body["not_ready"]} or {"gateway": f"/ready {exc.code}"}
        except (ValueError, KeyError, TypeError):
            return {"gateway": f"/ready answered {exc.code}"}
    except (urllib.error.URLError, OSError) as exc:
        return {"gateway": f"/ready does not answer ({exc})"}
