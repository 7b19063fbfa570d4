"""A service process, as the supervisor starts it: ``python -m services.runtime.serve``.

The supervisor's plan names this module for every ``app`` service; what the process does
(the app factory from ONECARD_SERVICE_APP, uvicorn through the guarded protocol, the
drain and its exit codes) is services.runtime.shell.process.
"""

import sys

from services.runtime.shell.process import main

if __name__ == "__main__":
    sys.exit(main())
