"""Loaded by Python at start-up when this folder is on PYTHONPATH (`engine.sh` puts it there for paced
engines): installs `kvgate_pacer`, which does nothing unless KVGATE_PACE_PROFILE is set."""

import kvgate_pacer

kvgate_pacer.install()
