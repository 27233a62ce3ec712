from dwdp.cli import main

raise SystemExit(main())
