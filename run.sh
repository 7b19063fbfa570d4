#!/bin/sh
# Container entrypoint. exec so that the supervisor is PID 1 and receives the signals.
exec onecard run "$@"
