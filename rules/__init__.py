from graphopt.layout import refuse_second_name

refuse_second_name(__name__, "rules")
