#!/usr/bin/env bash
# The README's two commands on a fresh Debian, as root: a minimal bookworm made by debootstrap (no
# python3, no git, no iproute2), entered the way a machine is (/ a mount point, /proc, /sys with its
# cgroups, /dev, a /dev/shm of its own), with a clone of this checkout's HEAD in /root/mpisgd.
#   bash scripts/fresh_debian_check.sh [DIR]      (default /tmp/mpisgd-fresh; log in DIR.log)
# Needs root, debootstrap (apt-get install debootstrap), a Debian mirror and PyPI; about 10 minutes
# here. Where this machine reaches the internet through a proxy with its own CA, the bundle named by
# $PIP_CERT (or /etc/ssl/certs/ca-certificates.crt) and /usr/local/share/ca-certificates go along.
# It checks what a green CI run on a prepared machine cannot: a missing install step. Exit status:
# that of the test command (non-zero if the first command failed).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/mpisgd-fresh}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "fresh_debian_check: needs root (debootstrap, mounts, chroot)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "fresh_debian_check: apt-get install debootstrap first" >&2; exit 2; }
[ ! -e "$dir" ] || { echo "fresh_debian_check: $dir exists; remove it or name another" >&2; exit 2; }

root=$dir/root-mount  # the system is bind-mounted onto itself here: 'ip netns' needs / to be a mount point
cleanup() { umount -R "$root" 2>/dev/null || true; }
trap cleanup EXIT
echo "[fresh] debootstrap --variant=minbase bookworm into $dir/system"
debootstrap --variant=minbase bookworm "$dir/system" "$mirror" >"$dir.debootstrap.log" 2>&1
mkdir -p "$root" && mount --bind "$dir/system" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys" && mount --rbind /sys/fs/cgroup "$root/sys/fs/cgroup"
mount --bind /dev "$root/dev" && mount -t devpts devpts "$root/dev/pts" && mount -t tmpfs -o size=4g tmpfs "$root/dev/shm"
cp /etc/resolv.conf /etc/hosts "$root/etc/" && hostname >"$root/etc/hostname"
mkdir -p "$root/etc/ssl/certs" "$root/usr/local/share/ca-certificates"
cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$root/etc/ssl/certs/ca-certificates.crt" 2>/dev/null || true
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
git clone -q "$here" "$root/root/mpisgd"
echo "[fresh] commit $(git -C "$here" rev-parse --short HEAD); the README's commands in it (log: $dir.log)"
set +e  # a failing command is the result, reported below
chroot "$root" env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin TERM=dumb \
  PIP_CERT=/etc/ssl/certs/ca-certificates.crt bash -c '
    cd /root/mpisgd
    echo "before: python3 $(command -v python3 || echo absent), git $(command -v git || echo absent)"
    time (bash scripts/install.sh && mpiexec -n 2 python3 -m mpisgd.train) || { echo "first command: FAILED"; exit 1; }
    echo "first command: OK"
    time bash scripts/test.sh' 2>&1 | tee "$dir.log"
status=${PIPESTATUS[0]}
echo "[fresh] exit $status; the system stays in $dir/system (rm -rf it when done)"
exit "$status"
