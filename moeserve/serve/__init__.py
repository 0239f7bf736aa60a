"""`moeserve serve`: an OpenAI-compatible HTTP server over continuous batching (needs `pip install moeserve[serve]`).

app.py (endpoints) -> batcher.py (the engine thread) -> engine/batching.py (the batch itself); protocol.py
(request bodies, errors), responses.py (response objects), chat_template.py, metrics.py, server.py (start-up),
process.py (a server in a child process). Importing this package imports no web framework.
"""
