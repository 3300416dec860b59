#!/bin/sh
# Stand-in for ssh under MPICH hydra (mpiexec -launcher ssh -launcher-exec THIS):
# hydra calls THIS [ssh options] HOST COMMAND...; run COMMAND inside HOST's network
# namespace, in a UTS namespace of its own named HOST. NETCLUSTER_HOSTS maps host
# names to namespaces: "h1=ns1 h2=ns2" (set by scripts/cluster/netcluster.py).
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take an argument
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
ns=
for pair in $NETCLUSTER_HOSTS; do
  case "$pair" in "$host="*) ns=${pair#*=} ;; esac
done
if [ -z "$ns" ]; then
  echo "netcluster launcher: unknown host '$host' (NETCLUSTER_HOSTS='$NETCLUSTER_HOSTS')" >&2
  exit 255
fi
# ssh hands the remote shell one command string: join the words and re-parse them the same way
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
