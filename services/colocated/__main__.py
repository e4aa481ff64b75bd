"""python -m services.colocated: one colocated worker (settings from DS_* variables)."""

from services.colocated.service import ColocatedService
from services.process import WorkerSettings
from services.runtime import serve

if __name__ == "__main__":
    serve("colocated", lambda: ColocatedService(WorkerSettings()))
