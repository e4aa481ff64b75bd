"""python -m services.gateway: the HTTP API (settings from DS_* variables)."""

import uvicorn

from services.gateway.app import GatewaySettings, create_app
from services.runtime import setup_logging

if __name__ == "__main__":
    setup_logging("gateway")
    settings = GatewaySettings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="warning")
