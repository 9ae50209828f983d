"""`keras-avae zoo`: one line per zoo entry, its description and whether it has pretrained weights."""


def _cmd_zoo(args):
    from keras_avae import zoo

    width = max(len(name) for name in zoo.names())
    for name in zoo.names():
        entry = zoo.describe(name)
        trained = " [pretrained]" if entry.get("weights") else ""
        print(f"{name:<{width}}  {entry['description']}{trained}")
