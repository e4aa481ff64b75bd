"""python -m services.planner: the planner service (settings from DS_* variables)."""

import asyncio

from services.planner.service import PlannerService, PlannerSettings
from services.process import run_until_signalled, setup_logging

if __name__ == "__main__":
    setup_logging("planner")
    service = PlannerService(PlannerSettings())
    asyncio.run(run_until_signalled(service.run))
