#!/usr/bin/env bash
# A Docker daemon for `make sam-local` and CI, started only when none answers:
#
#   scripts/dockerd.sh start   reuse a running daemon, else start dockerd (root) in the
#                              background and wait until it answers; its PID goes to
#                              build/dockerd/dockerd.pid
#   scripts/dockerd.sh stop    stop the daemon this script started (that PID only)
#
# Needs Debian's docker.io (dockerd, containerd, runc): apt-get install -y docker.io debootstrap
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=build/dockerd
PID_FILE=$DIR/dockerd.pid
LOG=$DIR/dockerd.log

answers() { docker info > /dev/null 2>&1; }

ours() { [[ -f $PID_FILE ]] && kill -0 "$(cat "$PID_FILE")" 2> /dev/null; }

start() {
    if answers; then
        echo "dockerd: a daemon answers already; using it"
        return
    fi
    command -v dockerd > /dev/null || {
        echo "dockerd: not installed (apt-get install -y docker.io debootstrap)" >&2
        exit 1
    }
    [[ $(id -u) == 0 ]] || { echo "dockerd: must start as root" >&2; exit 1; }
    mkdir -p "$DIR"
    nohup dockerd > "$LOG" 2>&1 &
    echo $! > "$PID_FILE"
    for _ in $(seq 1 120); do
        if answers; then
            echo "dockerd: started (pid $(cat "$PID_FILE"), log $LOG)"
            return
        fi
        ours || break
        sleep 0.5
    done
    tail -n 20 "$LOG" >&2
    echo "dockerd: did not come up" >&2
    exit 1
}

stop() {
    if ! ours; then
        echo "dockerd: none started here"
        return
    fi
    local pid
    pid=$(cat "$PID_FILE")
    kill -TERM "$pid"
    for _ in $(seq 1 60); do
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.5
    done
    rm -f "$PID_FILE"
    echo "dockerd: stopped (pid $pid)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
