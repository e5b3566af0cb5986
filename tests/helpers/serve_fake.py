"""`python -m tests.helpers.serve_fake PORT SETTINGS_JSON`: create_app over a FakeEngine, served by
uvicorn on 127.0.0.1:PORT with serve's interpreter settings (the GIL switch interval), for tests that
time a server from outside its interpreter: a client in the same process would share its GIL, and
the client's own work (an SSL context, a 10 MB JSON parse) would show up as the server's stalls.

SETTINGS_JSON: {"engine": FakeEngine's keyword arguments, "tokenizer": "chatml" or null (bytes),
"app": create_app's keyword arguments}.
"""

import json
import sys

import uvicorn

from orca_jax.server import gc_and_gil
from orca_jax.server.app import create_app
from orca_jax.server.http_limits import HTTPLimits

from tests.helpers.server import FakeEngine, chatml_tokenizer

if __name__ == "__main__":
    port, settings = int(sys.argv[1]), json.loads(sys.argv[2])
    tokenizer = chatml_tokenizer() if settings.get("tokenizer") == "chatml" else None
    app = create_app(FakeEngine(**settings.get("engine", {}), tokenizer=tokenizer), served_model_name="fake",
                     **settings.get("app", {}))
    gc_and_gil.shorten_gil_switch_interval()
    gc_and_gil.freeze_startup_heap()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **HTTPLimits().uvicorn_options())
