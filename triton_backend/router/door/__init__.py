"""The router's front door: its own tritonserver (server.py), the Python-backend model each
served model name runs inside it (model.py), and the router's end of their socket (inbox.py)."""
