"""The lab's HTTP app served by uvicorn in a thread, for the server and load-generator tests
(tests/test_serve.py, tests/test_loadgen.py)."""

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from lab.serve import create_app


@contextmanager
def serving(engine, **kw):
    """The app over `engine`, served by uvicorn in a thread on a free 127.0.0.1 port; yields (port, app)."""
    app = create_app(engine, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
