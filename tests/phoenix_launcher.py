"""Start Arize Phoenix (the OTLP backend of the e2e tests) bound to 127.0.0.1 only.

Phoenix binds its OTLP gRPC port on every interface ("[::]:PORT") with no setting
to change that; this launcher, run with Phoenix's own venv, rewrites that one
address to loopback before handing over to `phoenix serve`. Its HTTP port follows
PHOENIX_HOST (set to 127.0.0.1 by the caller).

    .venv-phoenix/bin/python tests/phoenix_launcher.py serve
"""

from __future__ import annotations

import sys

from grpc.aio import _server as _aio_server

_orig_insecure = _aio_server.Server.add_insecure_port


def _loopback(address: str) -> str:
    return address.replace("[::]", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


def _add_insecure_port(self, address: str) -> int:  # type: ignore[no-untyped-def]
    return _orig_insecure(self, _loopback(address))


_aio_server.Server.add_insecure_port = _add_insecure_port  # type: ignore[method-assign]

if __name__ == "__main__":
    from phoenix.server.main import main

    sys.argv = ["phoenix", *sys.argv[1:]]
    main()
