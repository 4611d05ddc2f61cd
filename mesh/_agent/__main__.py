"""``python -m mesh._agent``: run a host agent (the same as ``meshvisor agent``)."""

from mesh._agent.daemon import main

main()
