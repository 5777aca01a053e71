"""Which Debian packages a corpus needs, which are missing, and installing them (as root, with apt-get)."""

from __future__ import annotations

import shutil
import subprocess

from moekit.errors import MoekitError


def installed(package: str) -> bool:
    if shutil.which("dpkg-query") is None:
        return False
    done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return done.returncode == 0 and "install ok installed" in done.stdout


def missing(packages: list[str]) -> list[str]:
    return [p for p in dict.fromkeys(packages) if not installed(p)]


def install(packages: list[str], say) -> None:
    """apt-get update, then install `packages`; one line naming them if it fails."""
    if shutil.which("apt-get") is None:
        raise MoekitError(f"apt-get not found: install {' '.join(packages)} by hand, or pass --no-install")
    say(f"installing with apt-get: {' '.join(packages)}")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        done = subprocess.run(cmd, capture_output=True, text=True, env={"DEBIAN_FRONTEND": "noninteractive",
                                                                        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise MoekitError(f"{' '.join(cmd[:2])} failed: {last}")
