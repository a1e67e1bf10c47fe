"""Prebuilt (ahead-of-time) native ops land here when the wheel is built with DS_BUILD_OPS=1 or DS_BUILD_<OP>=1."""
