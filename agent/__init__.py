import os as _os

# gRPC's C core writes its own lines to stderr ("I1201 04:44:14 ... Handshake
# failed", one per reconnect attempt), outside the JSON log and at level I for
# what is an error; the daemons say what failed in their own events. It reads
# the variable once, when grpc is first imported, which this package's modules
# do after this line. An operator who wants them sets GRPC_VERBOSITY.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
