#!/bin/sh
# Fails if any tutti shared-memory segment is left in /dev/shm (run after the whole suite).
leaks=$(ls /dev/shm 2>/dev/null | grep '^tutti-' || true)
if [ -n "$leaks" ]; then
  echo "leaked shared-memory segments:"
  echo "$leaks"
  exit 1
fi
echo "no tutti segments in /dev/shm"
