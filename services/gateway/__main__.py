"""python -m services.gateway: the HTTP API (settings from DS_* variables)."""

import socket

import uvicorn

from services.gateway.app import GatewaySettings, create_app
from services.process import built_or_exit, setup_logging

if __name__ == "__main__":
    setup_logging("gateway")
    settings = built_or_exit("gateway", GatewaySettings)
    app = built_or_exit("gateway", lambda: create_app(settings))
    if settings.listen_fd is None:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    else:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(
            sockets=[socket.socket(fileno=settings.listen_fd)])
