"""Cross-origin and Host checks (DNS rebinding, web pages driving a local server).

A browser sends `Origin` on every cross-origin POST. A request whose `Origin` is neither the
server's own origin (same scheme-less host:port as its `Host`) nor in `--allowed-origins` is a 403
(`*` allows any; a preflight `OPTIONS` from an allowed origin gets the CORS headers). `Host` must name
the server: loopback names and the bound host by default, or `--allowed-hosts`; a server bound to
a wildcard address (0.0.0.0, ::) accepts any Host unless `--allowed-hosts` is given, since its
clients reach it under names it cannot know (an app built without a bind host, as in tests, too). Non-browser clients (curl, SDKs, routers) send no
Origin and a Host naming the server, so they are unaffected.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from trnrt.serve.http.errors import APIError, safe

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _host_only(hostport: str) -> str:
    h = hostport.strip().lower()
    if h.startswith("["):  # [::1]:30000
        return h[1:h.index("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


class OriginMiddleware:
    """403 for requests from foreign origins or to foreign Host names (see the module docstring)."""

    def __init__(self, allowed_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] | None = None,
                 bind_host: str | None = None):
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if o != "*"}
        if allowed_hosts:
            self.hosts = None if "*" in allowed_hosts else {_host_only(h) for h in allowed_hosts}
        elif bind_host is None or bind_host.strip() in WILDCARD_HOSTS:
            self.hosts = None  # bound to a wildcard (or unknown: create_app without a bind host)
        else:
            self.hosts = set(LOOPBACK_HOSTS) | ({_host_only(bind_host)} if bind_host else set())

    def _origin_ok(self, origin: str, host_header: str) -> bool:
        o = origin.rstrip("/").lower()
        if self.any_origin or o in self.origins:
            return True
        parts = urlsplit(o)
        # same origin: the page was served by this server
        return bool(parts.netloc) and parts.netloc == host_header.strip().lower()

    def process_request(self, req, resp) -> None:
        host = req.get_header("Host") or ""
        if self.hosts is not None and host and _host_only(host) not in self.hosts:
            raise APIError(403, f"Host {safe(host)!r} is not allowed (see --allowed-hosts)", "Host",
                           type_="permission_error")
        origin = req.get_header("Origin")
        if origin is None:
            return
        if not self._origin_ok(origin, host):
            raise APIError(403, f"Cross-origin request from {safe(origin)!r} refused (see --allowed-origins)",
                           "Origin", type_="permission_error")
        resp.set_header("Access-Control-Allow-Origin", origin)
        resp.set_header("Vary", "Origin")
        if req.method == "OPTIONS":  # a preflight from an allowed origin
            resp.set_header("Access-Control-Allow-Methods", "GET, POST, PUT, OPTIONS")
            resp.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
            resp.set_header("Access-Control-Max-Age", "600")
            resp.status = 204
            resp.complete = True
