def main(argv=None):
    raise SystemExit("draftforge CLI under construction")
