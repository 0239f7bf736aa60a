import sys

from moeserve.train.run import main

sys.exit(main())
