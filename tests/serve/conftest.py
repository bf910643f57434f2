"""Fixtures for the serve tests; the helpers live in serve_support.py.

Test modules import helpers from `serve_support`, never from `conftest`: with several test
directories in one run (pytest-xdist), a bare `conftest` module name resolves to whichever
directory's conftest was imported first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve_support import any_server, scripted_server, tok_dir, tokenizer, tokenizer_factory  # noqa: E402,F401
