"""The torch backend: runs a plan's stage graph on a real model and device (`kvpipe run`), one
subpackage per concern; it executes the plan it is given and never chooses another."""
