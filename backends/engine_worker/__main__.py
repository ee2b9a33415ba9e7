"""`python -m backends.engine_worker LAUNCH_JSON`: started by the gateway's `EngineWorkerBackend`."""

import sys

from backends.engine_worker.worker import main

sys.exit(main(sys.argv[1:]))
