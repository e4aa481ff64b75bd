"""python -m services.decode: one decode instance (settings from DS_* variables)."""

import asyncio

from services.decode.service import DecodeService
from services.runtime import WorkerSettings, run_until_signalled, setup_logging

if __name__ == "__main__":
    setup_logging("decode")
    service = DecodeService(WorkerSettings())
    asyncio.run(run_until_signalled(service.run))
