"""A small inventory ledger: the text the code-editing load asks a model to edit.

Original code written for kvserve's benchmark (bench/serve.py --load code); it is
never imported or run.
"""

from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0
    tags: list = field(default_factory=list)

    def total(self):
        return self.price * self.quantity

    def restock(self, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.quantity += amount
        return self.quantity

    def sell(self, amount):
        if amount > self.quantity:
            raise ValueError(f"only {self.quantity} of {self.name} left")
        self.quantity -= amount
        return self.price * amount


class Ledger:
    def __init__(self):
        self.items = {}
        self.history = []

    def add(self, item):
        if item.name in self.items:
            raise KeyError(f"{item.name} is already in the ledger")
        self.items[item.name] = item
        self.history.append(("add", item.name, item.quantity))

    def remove(self, name):
        item = self.items.pop(name)
        self.history.append(("remove", name, item.quantity))
        return item

    def restock(self, name, amount):
        count = self.items[name].restock(amount)
        self.history.append(("restock", name, amount))
        return count

    def sell(self, name, amount):
        income = self.items[name].sell(amount)
        self.history.append(("sell", name, amount))
        return income

    def value(self):
        return sum(item.total() for item in self.items.values())

    def low_stock(self, limit=5):
        return sorted(name for name, item in self.items.items() if item.quantity < limit)

    def tagged(self, tag):
        return [item for item in self.items.values() if tag in item.tags]

    def report(self):
        lines = []
        for name in sorted(self.items):
            item = self.items[name]
            lines.append(f"{name:<20} {item.quantity:>6} x {item.price:>8.2f} = {item.total():>10.2f}")
        lines.append(f"{'total':<20} {'':>6}   {'':>8}   {self.value():>10.2f}")
        return "\n".join(lines)


def parse_line(line):
    parts = [part.strip() for part in line.split(",")]
    if len(parts) < 3:
        raise ValueError(f"expected name, price, quantity: {line!r}")
    name, price, quantity = parts[0], float(parts[1]), int(parts[2])
    tags = [tag for tag in parts[3:] if tag]
    return Item(name, price, quantity, tags)


def load_ledger(lines):
    ledger = Ledger()
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            ledger.add(parse_line(line))
        except (ValueError, KeyError) as error:
            raise ValueError(f"line {number}: {error}") from None
    return ledger


def merge(first, second):
    merged = Ledger()
    for ledger in (first, second):
        for item in ledger.items.values():
            if item.name in merged.items:
                merged.restock(item.name, item.quantity)
            else:
                merged.add(Item(item.name, item.price, item.quantity, list(item.tags)))
    return merged


def busiest(ledger, count=3):
    moves = {}
    for kind, name, amount in ledger.history:
        if kind in ("sell", "restock"):
            moves[name] = moves.get(name, 0) + amount
    return sorted(moves, key=lambda name: (-moves[name], name))[:count]
