"""One `trnrt serve --tp-size 2` server (the embedded tiny model, two rank processes) for the
module, as an `any_server` the serve suite's tests run against unchanged; its helpers are
tests/serve's serve_support (put on sys.path here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "serve"))

from tp_support import any_server, tok_dir, tokenizer, tokenizer_factory, tp_server  # noqa: E402,F401
