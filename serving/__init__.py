"""Serving a Fiber Bundle model: ``fiber-bundle serve`` runs transformers' own OpenAI-compatible server on it
(server.py; loader.py is what makes the server load a remote-code model). docs/deployment.md, "Serving"."""
